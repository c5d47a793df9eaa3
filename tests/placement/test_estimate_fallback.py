"""An estimate that fails for a reason of the model's (a branch on data, a shape error in its own code) falls back
to a stated weights-only estimate within `weights_only_fallback`, and only then; a bug (a TypeError, an
AttributeError) is raised, not swallowed. With `outputs_needed`, the fallback gives the call's output from a run
with guessed values, or raises when there is none."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from placement.activations.estimate import ActivationEstimateError, estimate_call
from placement.activations.fallback import weights_only_fallback
from placement.sizes import parse_size


class BranchesOnData(nn.Module):
    """`if torch.all(image == 0):` as HunyuanVideo 1.5's transformer does: fake tensors have no values to branch on."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x, image):
        hidden = self.proj(x)
        if torch.all(image == 0):
            hidden = hidden * 0.0
        return hidden[image.sum(-1) > 0] if image.dim() == 2 and x.dim() == 2 else hidden


class MasksByValue(nn.Module):
    """`x[mask]`: an output sized by values."""

    def forward(self, x, mask):
        return x[mask].sum(0, keepdim=True) + x[0]


class ShapeErrorInItsCode(nn.Module):
    def forward(self, x):
        return x.flatten(1) @ torch.zeros(3, 3, device=x.device)


class BugOfItsOwn(nn.Module):
    def forward(self, x):
        return self.missing_layer(x)


class WrongArgument(nn.Module):
    def forward(self, x):
        return torch.cat(x, dim=0)  # a tensor where a sequence is wanted: a TypeError


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_a_branch_on_data_raises_without_the_fallback():
    with pytest.raises(ActivationEstimateError) as raised:
        estimate_call(BranchesOnData().to("meta"), (meta(2, 8, 4), meta(2, 3)))
    assert raised.value.model_failure and raised.value.reads_values
    assert "DataDependentOutputException" in raised.value.cause


def test_a_branch_on_data_falls_back_to_weights_only_with_the_output_a_real_run_gives():
    module = BranchesOnData()
    x, image = torch.randn(2, 8, 4), torch.zeros(2, 3)
    with weights_only_fallback(outputs_needed=True) as fallbacks:
        estimate = estimate_call(module, (x.to("meta"), image.to("meta")))
    assert estimate.peak_bytes == 0 and "DataDependentOutputException" in estimate.fallback
    assert estimate.output.shape == module(x, image).shape and estimate.output.device.type == "meta"
    assert estimate.flops == 2 * 2 * 8 * 4 * 6  # the linear's multiply-adds, as counted on the guessed run
    (record,) = fallbacks.records
    assert record.module() is module and record.output_known and record.reads_values
    assert "BranchesOnData.forward" in record.call and "reads tensor values" in record.explanation
    assert fallbacks.of(module) == [record] and fallbacks.of(nn.Linear(1, 1)) == []


def test_a_boolean_mask_is_guessed_as_every_position():
    with weights_only_fallback(outputs_needed=True) as fallbacks:
        estimate = estimate_call(MasksByValue(), (meta(5, 3), meta(5, dtype=torch.bool)))
    assert estimate.output.shape == (1, 3) and estimate.peak_bytes == 0
    assert len(fallbacks.records) == 1


def test_a_shape_error_in_the_models_code_falls_back_only_where_no_output_is_needed():
    module = ShapeErrorInItsCode()
    with pytest.raises(ActivationEstimateError) as raised:
        estimate_call(module, (meta(2, 4),))
    assert raised.value.model_failure and not raised.value.reads_values
    with weights_only_fallback() as fallbacks:
        estimate = estimate_call(module, (meta(2, 4),))
    assert estimate.peak_bytes == 0 and estimate.output is None and "same reduction dim" in estimate.fallback
    assert not fallbacks.records[0].output_known
    with weights_only_fallback(outputs_needed=True) as needed, pytest.raises(ActivationEstimateError):
        estimate_call(module, (meta(2, 4),))  # no output to pass on: the capture cannot go on without one
    assert needed.records == []


@pytest.mark.parametrize("module", [BugOfItsOwn(), WrongArgument()], ids=type)
def test_a_programming_error_is_not_swallowed(module):
    with weights_only_fallback() as fallbacks, pytest.raises(ActivationEstimateError) as raised:
        estimate_call(module, (meta(2, 4),))
    assert not raised.value.model_failure and fallbacks.records == []
    assert isinstance(raised.value.__cause__, (AttributeError, TypeError))


class CallsThisLibraryWrongly(nn.Module):
    def forward(self, x):
        return x * parse_size("ten gigs")  # a ValueError raised in this library's code, not in torch's or the model's


def test_an_error_raised_in_this_librarys_code_is_not_the_models():
    with weights_only_fallback() as fallbacks, pytest.raises(ActivationEstimateError) as raised:
        estimate_call(CallsThisLibraryWrongly(), (meta(2, 4),))
    assert not raised.value.model_failure and fallbacks.records == []


def test_a_fallback_inside_another_is_passed_on_and_the_context_ends_clean():
    module = BranchesOnData().to("meta")
    with weights_only_fallback() as outer:
        with weights_only_fallback(outputs_needed=True) as inner:
            estimate_call(module, (meta(2, 8, 4), meta(2, 3)))
    assert len(inner.records) == len(outer.records) == 1
    with pytest.raises(ActivationEstimateError):  # outside any fallback: raised as before
        estimate_call(module, (meta(2, 8, 4), meta(2, 3)))


def test_the_real_hunyuan_video_15_transformer_falls_back_with_its_real_output_shape():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=2, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 4, 2),
        target_size=64).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6, dtype=torch.long),
                  encoder_hidden_states_2=torch.randn(1, 5, 8),
                  encoder_attention_mask_2=torch.ones(1, 5, dtype=torch.long), image_embeds=torch.zeros(1, 7, 12))
    with torch.no_grad():
        real = model(**inputs).sample
    with pytest.raises(ActivationEstimateError):  # `if is_t2v:` on fake tensors
        estimate_call(model, (), inputs)
    with weights_only_fallback(outputs_needed=True) as fallbacks:
        estimate = estimate_call(model, (), inputs)
    assert estimate.output.sample.shape == real.shape and estimate.peak_bytes == 0 and estimate.flops > 0
    assert fallbacks.records[0].reads_values
