"""TextEncoder: shapes, masking, causality, pooling and input errors (tiny CLIP-like and T5-like presets)."""

from __future__ import annotations

import pytest
import torch

from pipelines.errors import CallError
from pipelines.text_to_image.models import TextEncoder, TextEncoderOutput
from pipelines.text_to_image.tokenizers import ByteTokenizer

from reference_inputs import text_inputs, tiny
from same_output import assert_same_output, same_output


@pytest.fixture(scope="module", params=["tiny", "tiny-t5"])
def encoder(request):
    return tiny(TextEncoder, request.param)


def test_output_shapes_and_type(encoder):
    ids, mask = text_inputs(encoder)
    with torch.no_grad():
        output = encoder(ids, mask)
    config = encoder.config
    assert isinstance(output, TextEncoderOutput) and isinstance(output, tuple)  # hooks move tuples
    assert output.last_hidden_state.shape == (2, 12, config.hidden_size)
    assert output.pooled_output.shape == (2, config.projection_dim or config.hidden_size)
    assert torch.isfinite(output.last_hidden_state).all()


def test_padding_changes_nothing_on_the_kept_tokens(encoder):
    """A text padded to 6 or to 14 tokens gives the same states and pooled output: the mask does its job."""
    ids, _ = text_inputs(encoder, batch=1, length=6)
    padded = torch.cat([ids, torch.zeros(1, 8, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 8)], dim=1).long()
    with torch.no_grad():
        short = encoder(ids, torch.ones_like(ids))
        long = encoder(padded, mask)
    assert_same_output(long.last_hidden_state[:, :6], short.last_hidden_state)
    assert_same_output(long.pooled_output, short.pooled_output)


def test_clip_like_encoder_is_causal_and_t5_like_is_not():
    for preset, causal in (("tiny", True), ("tiny-t5", False)):
        model = tiny(TextEncoder, preset)
        ids, _ = text_inputs(model, batch=1, length=8)
        changed = ids.clone()
        changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
        with torch.no_grad():
            before, after = model(ids).last_hidden_state, model(changed).last_hidden_state
        assert same_output(before[:, :-1], after[:, :-1]) == causal, preset  # causal: the changed token is masked out


def test_last_token_pooling_takes_the_last_kept_token_then_projects():
    model = tiny(TextEncoder, "tiny")
    ids, mask = text_inputs(model)  # row 1 keeps its first 6 tokens
    with torch.no_grad():
        output = model(ids, mask)
        expected = model.projection(output.last_hidden_state[torch.arange(2), torch.tensor([11, 5])])
    assert_same_output(output.pooled_output, expected)


def test_mean_pooling_averages_the_kept_tokens():
    model = tiny(TextEncoder, "tiny-t5")
    ids, mask = text_inputs(model)
    with torch.no_grad():
        output = model(ids, mask)
    expected = output.last_hidden_state[1, :6].mean(dim=0)
    assert_same_output(output.pooled_output[1], expected)


def test_byte_tokenizer_output_feeds_every_tiny_encoder(encoder):
    tokens = ByteTokenizer()(["a photo of a cat", "é"], max_length=encoder.config.max_position_embeddings)
    with torch.no_grad():
        output = encoder(tokens["input_ids"], attention_mask=tokens["attention_mask"])
    assert output.last_hidden_state.shape[:2] == tokens["input_ids"].shape


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda m: (torch.tensor([[1, 2, m.config.vocab_size]]),), "vocab_size"),
        (lambda m: (torch.tensor([[1, -1, 2]]),), "vocab_size"),
        (lambda m: (torch.ones(1, m.config.max_position_embeddings + 1, dtype=torch.long),), "max_position_embeddings"),
        (lambda m: (torch.ones(3, dtype=torch.long),), "2-d"),
        (lambda m: (torch.ones(1, 4, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)), "attention_mask"),
    ],
)
def test_bad_inputs_raise_a_typed_error_naming_the_problem(make_args, message):
    model = tiny(TextEncoder, "tiny")
    with pytest.raises(CallError, match=message):
        model(*make_args(model))
