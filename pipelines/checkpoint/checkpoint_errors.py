"""Typed errors of the checkpoint folder format.

Each one names the file, the keys and the numbers involved, and says what to do. They subclass
`pipelines.errors.FolderError` (a folder's files) and `ValueError`, because a bad checkpoint is bad input;
a failed save is a `RuntimeError`.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import FolderError

_LISTED = 10  # how many names a message spells out before it says "and N more"


class CheckpointError(FolderError, ValueError):
    """Base of every error about a checkpoint folder or its files."""


class WeightsNotFoundError(CheckpointError, FileNotFoundError):
    """No weights file, a shard named by the index that is absent, or a folder that does not exist."""


class VariantNotFoundError(WeightsNotFoundError):
    """The requested variant (e.g. "fp16") has no weights in the folder; the message lists those that do."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or an index json that cannot be parsed (truncated, garbage, wrong schema)."""


class CheckpointKeysError(CheckpointError):
    """The checkpoint's tensor names do not match the model's: missing and/or unexpected keys."""


class CheckpointShapeError(CheckpointError):
    """A tensor whose shape in the checkpoint differs from the model's."""


class CheckpointReadError(CheckpointError, OSError):
    """An I/O error while reading weights (the disk, a file removed or made unreadable during the load)."""


class CheckpointDtypeError(CheckpointError):
    """A checkpoint tensor whose dtype the model cannot take as is (an int32 for an int64 buffer, or one
    float16 tensor among float32 ones with no `torch_dtype` asking for a cast)."""


class UnsafeCheckpointPathError(CheckpointError):
    """An index names a file outside its component folder (a path with separators, '..' or absolute)."""


class InvalidConfigError(CheckpointError):
    """A config.json that does not validate against the model's config class (names the field)."""


class CheckpointSaveError(FolderError, RuntimeError):
    """Saving failed; the existing checkpoint (if any) is left untouched."""


def list_names(names: Iterable[str]) -> str:
    """'a', 'b', 'c' (and 12 more): long key lists stay readable in one message."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return f"{shown} (and {more} more)" if more > 0 else shown
