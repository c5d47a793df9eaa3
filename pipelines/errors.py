"""The errors of `pipelines`: one base per stage, and the few types that callers catch.

    placement.errors.PlacementError
    ├── FolderError             what a saved folder holds, or saving one (ValueError)
    │   ├── UntrustedClassError       model_index.json names a class the folder may not run (caught: skipped when
    │   │                             the caller passes that component)
    │   ├── FolderChangedError        saved over during every attempt to load it (RuntimeError; retry the load)
    │   ├── WeightsNotFoundError      weights that cannot be had (FileNotFoundError; caught: plan from configs)
    │   ├── CheckpointShapeError      a tensor whose stored shape differs from the model's
    │   └── CheckpointSaveError       saving failed, the existing checkpoint untouched (RuntimeError)
    ├── LoadError               a load or plan request that cannot be carried out (ValueError)
    │   ├── UnknownKeywordError       a keyword no entry takes (TypeError, as Python says it)
    │   ├── CallSpecError             a `call=` the pipeline cannot be planned for (caught: plan without it)
    │   ├── MissingComponentsError    the folder lacks components its diffusers class needs (caught: plan anyway)
    │   ├── PipelineLoadError         a load that failed while running (RuntimeError)
    │   └── ReplicaLoadError          ranks of a launch that could not load their replica (RuntimeError)
    └── CallError               a pipeline called with inputs it cannot take (ValueError)
        └── ImageRunError             a `placement run` whose prompts, folder or images failed (RuntimeError)

Everything else is said by the message (which names the input, the numbers and the fix), not by a type.
"""

from __future__ import annotations

from typing import Iterable

from placement.errors import PlacementError

_LISTED = 10  # how many names a message spells out before it says "and N more"


class FolderError(PlacementError, ValueError):
    """A saved folder that cannot be read as asked, or a save that cannot be done."""


class UntrustedClassError(FolderError):
    """model_index.json names a class outside this library, diffusers, transformers and the registered classes;
    a load that is passed that component catches it and never imports the class."""


class FolderChangedError(FolderError, RuntimeError):
    """The folder was saved over during every attempt to load it; the remedy is to load again later."""


class WeightsNotFoundError(FolderError, FileNotFoundError):
    """Weights that cannot be had (no file, an absent shard, a variant without weights, a file unreadable
    mid-load); a `FileNotFoundError` so callers that catch those keep working."""


class CheckpointShapeError(FolderError):
    """A tensor whose shape in the checkpoint differs from the model's; an adapter load catches it to name its
    file."""


class CheckpointSaveError(FolderError, RuntimeError):
    """Saving failed (a checkpoint, or a file the CLI writes), the existing one untouched; a save nested in
    another's is said once, for the outer."""


def list_names(names: Iterable[str]) -> str:
    """'a', 'b', 'c' (and 12 more): long key lists stay readable in one message."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return f"{shown} (and {more} more)" if more > 0 else shown


class LoadError(PlacementError, ValueError):
    """A load or plan request that cannot be carried out as asked."""


class UnknownKeywordError(LoadError, TypeError):
    """A keyword that is no argument, component or diffusers loading keyword; a `TypeError`, as Python's."""


class CallSpecError(LoadError):
    """A `call=` the pipeline cannot be planned for; planning catches it to fall back to a plan without it."""


class MissingComponentsError(LoadError):
    """The folder lacks components its diffusers class requires (`missing`); planning goes ahead without them."""

    def __init__(self, message: str, *, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class PipelineLoadError(LoadError, RuntimeError):
    """A load that failed while running, not for its arguments."""


class ReplicaLoadError(LoadError, RuntimeError):
    """Ranks of a launch that could not plan or load their replica; every rank raises it alike, so that the
    command reports it once."""


class CallError(PlacementError, ValueError):
    """A pipeline (or one of its parts) called with inputs it cannot take; raised before any work is done."""


class ImageRunError(CallError, RuntimeError):
    """A `placement run` whose prompts, output folder or images failed; every rank raises it alike."""


__all__ = ["CallError", "CallSpecError", "CheckpointSaveError", "CheckpointShapeError", "FolderChangedError",
           "FolderError", "ImageRunError", "LoadError", "MissingComponentsError", "PipelineLoadError",
           "ReplicaLoadError", "UnknownKeywordError", "UntrustedClassError", "WeightsNotFoundError"]
