"""ByteTokenizer: UTF-8 bytes as tokens, plus PAD/BOS/EOS. No vocabulary file, no download.

Ids: PAD = 0, BOS = 1, EOS = 2, byte b = b + 3 (vocabulary of 259, which every reference text encoder
preset covers). A text becomes `[BOS] bytes [EOS]`, right-padded with PAD; truncation cuts the bytes, never
the EOS, so a text encoder's last-token pooling always lands on EOS."""

from __future__ import annotations

from enum import Enum
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from ..errors import CallError
from ..folder.class_registry import library_class
from .config_file import ConfigFileComponent

TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


class Padding(str, Enum):
    MAX_LENGTH = "max_length"  # every row padded to max_length
    LONGEST = "longest"  # rows padded to the longest text of the batch


class ByteTokenizerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_max_length: PositiveInt = 77


@library_class
class ByteTokenizer(ConfigFileComponent):
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    byte_offset = 3
    vocab_size = 256 + byte_offset
    config_class = ByteTokenizerConfig
    config_name = TOKENIZER_CONFIG_NAME

    @property
    def model_max_length(self) -> int:
        return self._config.model_max_length

    def __call__(self, texts: str | Sequence[str], max_length: int | None = None,
                 padding: Padding | str = Padding.MAX_LENGTH, truncation: bool = True) -> dict[str, torch.Tensor]:
        """{"input_ids": (B, L) int64, "attention_mask": (B, L) int64, 1 on real tokens}."""
        texts = [texts] if isinstance(texts, str) else texts
        if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Sequence) or not texts or not all(
            isinstance(text, str) for text in texts
        ):
            raise CallError(f"ByteTokenizer takes a string or a non-empty list of strings, got {texts!r}.")
        padding = _parse_padding(padding)
        max_length = self.model_max_length if max_length is None else max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise CallError(f"max_length must be an integer >= 2 (room for BOS and EOS), got {max_length!r}.")
        rows = [self._encode_one(index, text, max_length, truncation) for index, text in enumerate(texts)]
        length = max_length if padding is Padding.MAX_LENGTH else max(len(row) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[index, : len(row)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def _encode_one(self, index: int, text: str, max_length: int, truncation: bool) -> list[int]:
        content = [byte + self.byte_offset for byte in text.encode("utf-8")]
        room = max_length - 2
        if len(content) > room:
            if not truncation:
                raise CallError(
                    f"Text {index} is {len(content) + 2} tokens (with BOS/EOS) but max_length is {max_length}; "
                    f"pass truncation=True or a larger max_length."
                )
            content = content[:room]
        return [self.bos_token_id, *content, self.eos_token_id]

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of one row of ids; special tokens dropped, a byte sequence cut by truncation replaced."""
        values = ids.tolist() if torch.is_tensor(ids) else list(ids)
        data = bytes(value - self.byte_offset for value in values if self.byte_offset <= value < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def batch_decode(self, ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(row) for row in ids]


def _parse_padding(padding: Padding | str) -> Padding:
    try:
        return Padding(padding)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in Padding)
        raise CallError(f"padding={padding!r} is not supported; use one of {allowed}.") from None
