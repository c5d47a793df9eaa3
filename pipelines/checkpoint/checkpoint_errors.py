"""The errors of the checkpoint format that callers catch, and the helper that lists names in a message.

Every other problem of a checkpoint (a corrupt file, keys or dtypes that do not match, a config that does not
validate, an unsafe path) is a `pipelines.errors.FolderError` whose message names the file, the keys and the
numbers involved, and says what to do.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import FolderError

_LISTED = 10  # how many names a message spells out before it says "and N more"


class WeightsNotFoundError(FolderError, FileNotFoundError):
    """Weights that cannot be had: no weights file, a shard the index names that is absent, a variant that has no
    weights (the message lists those that do), a folder that does not exist, or a weights file that failed to
    read mid-load (removed, unreadable). A `FileNotFoundError` (an `OSError`), so that callers that catch those
    keep working; the loader catches it to plan from configs alone."""


class CheckpointShapeError(FolderError):
    """A tensor whose shape in the checkpoint differs from the model's. Its own type because an adapter load
    catches it to name the file the tensor came from."""


class CheckpointSaveError(FolderError, RuntimeError):
    """Saving failed; the existing checkpoint (if any) is left untouched. Its own type because a save nested in
    another's staging folder is caught and said once, for the outer target."""


def list_names(names: Iterable[str]) -> str:
    """'a', 'b', 'c' (and 12 more): long key lists stay readable in one message."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return f"{shown} (and {more} more)" if more > 0 else shown


__all__ = ["CheckpointSaveError", "CheckpointShapeError", "WeightsNotFoundError"]
