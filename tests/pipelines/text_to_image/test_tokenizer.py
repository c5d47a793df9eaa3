"""ByteTokenizer: ids layout, padding, truncation that keeps EOS, decoding, save/load, typed errors."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.errors import CallError, FolderError
from pipelines.text_to_image.tokenizers import ByteTokenizer

BOS, EOS, PAD = ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id, ByteTokenizer.pad_token_id


def test_bytes_are_wrapped_in_bos_eos_and_right_padded_to_max_length():
    tokens = ByteTokenizer()(["ab", "é"], max_length=6)
    e_acute = list("é".encode())  # two UTF-8 bytes
    assert tokens["input_ids"].tolist() == [
        [BOS, 3 + 97, 3 + 98, EOS, PAD, PAD],
        [BOS, 3 + e_acute[0], 3 + e_acute[1], EOS, PAD, PAD],
    ]
    assert tokens["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert tokens["input_ids"].dtype == tokens["attention_mask"].dtype == torch.long


def test_defaults_and_longest_padding():
    tokenizer = ByteTokenizer(model_max_length=10)
    assert tokenizer("hi")["input_ids"].shape == (1, 10)
    tokens = tokenizer(["hi", "hello"], padding="longest")
    assert tokens["input_ids"].shape == (2, 7)
    assert tokens["attention_mask"].sum(dim=1).tolist() == [4, 7]


def test_truncation_cuts_the_text_and_keeps_eos():
    tokens = ByteTokenizer()("a long sentence", max_length=5)
    row = tokens["input_ids"][0].tolist()
    assert row[0] == BOS and row[-1] == EOS and len(row) == 5
    assert ByteTokenizer().decode(row) == "a l"


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40))
def test_decode_inverts_encode(text):
    tokenizer = ByteTokenizer()
    tokens = tokenizer(text, max_length=200)
    assert tokenizer.decode(tokens["input_ids"][0]) == text
    assert int(tokens["input_ids"].max()) < ByteTokenizer.vocab_size


def test_save_and_load_round_trip(tmp_path):
    tokenizer = ByteTokenizer(model_max_length=32)
    path = tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert json.loads(path.read_text()) == {"_class_name": "ByteTokenizer", "model_max_length": 32}
    loaded = ByteTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert loaded.config == tokenizer.config
    assert torch.equal(loaded("x")["input_ids"], tokenizer("x")["input_ids"])


def test_too_long_without_truncation_names_the_text():
    with pytest.raises(CallError, match=r"Text 1 is 12 tokens .* max_length is 8"):
        ByteTokenizer()(["ok", "0123456789"], max_length=8, truncation=False)


@pytest.mark.parametrize(
    "texts, kwargs, message",
    [
        ([], {}, "non-empty list of strings"),
        ([1, 2], {}, "non-empty list of strings"),
        (b"bytes", {}, "non-empty list of strings"),
        ("x", {"padding": "do_not_pad"}, "'max_length', 'longest'"),
        ("x", {"padding": True}, "padding=True"),
        ("x", {"max_length": 1}, "max_length must be an integer >= 2"),
    ],
)
def test_bad_calls_raise_a_typed_error(texts, kwargs, message):
    with pytest.raises(CallError, match=message):
        ByteTokenizer()(texts, **kwargs)


def test_bad_settings_and_files(tmp_path):
    with pytest.raises(CallError, match="model_max_length"):
        ByteTokenizer(model_max_length=0)
    with pytest.raises(FolderError, match="No tokenizer_config.json"):
        ByteTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"vocab_file": "x.txt"}))
    with pytest.raises(FolderError, match="unknown field 'vocab_file'"):
        ByteTokenizer.from_pretrained(tmp_path)
