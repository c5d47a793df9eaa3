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

Everything else is said by the message (which names the input, the numbers and the fix), not by a type. This
module sits below every subpackage (it imports none of them); the package face exports every name in
`__all__` here. Every other problem of a checkpoint (a corrupt file, keys or dtypes that do not match, a
config that does not validate, an unsafe path) is a `FolderError` whose message names the file, the keys and the
numbers involved, and says what to do.
"""

from __future__ import annotations

from typing import Iterable

from placement.errors import PlacementError

_LISTED = 10  # how many names a message spells out before it says "and N more"


class FolderError(PlacementError, ValueError):
    """A saved folder that cannot be read as asked: its files, its model_index.json, its classes, its
    components' folders, or a save that cannot be done."""


class UntrustedClassError(FolderError):
    """model_index.json names a class outside this library, diffusers, transformers and the registered classes.
    Its own type because a load that is passed that component catches it and never imports the class."""


class FolderChangedError(FolderError, RuntimeError):
    """The folder was saved over during every attempt to load it, so no consistent snapshot could be read.
    Its own type because the caller's remedy is to load again once the saving stops."""


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


class LoadError(PlacementError, ValueError):
    """A load or plan request that cannot be carried out as asked: its arguments, formats, quantization, saved
    plans, single files, presets, or the folder given to the command."""


class UnknownKeywordError(LoadError, TypeError):
    """A keyword argument that is no argument of the entry, no component and no loading keyword of diffusers.
    A `TypeError`, as Python raises for an unexpected keyword."""


class CallSpecError(LoadError):
    """A `call=` the pipeline cannot be planned for (the message says which keyword, and why). Its own type
    because planning catches it to fall back to a plan without the call."""


class MissingComponentsError(LoadError):
    """The folder lacks components its diffusers class requires (`missing`); planning, which needs only the
    models, catches it and goes ahead without them."""

    def __init__(self, message: str, *, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class PipelineLoadError(LoadError, RuntimeError):
    """A load that failed while running, not for its arguments: a component built without weights, a component
    its owner library refused or could not place, a pipeline that could not be assembled."""


class ReplicaLoadError(LoadError, RuntimeError):
    """One or more ranks of a launch could not plan or load their replica; the message names each and why.
    Every rank raises it alike, so that the command reports it once (from rank 0)."""


class CallError(PlacementError, ValueError):
    """A pipeline (or one of its models, tokenizer, scheduler, its VAE's features) called with inputs it cannot
    take; raised before any work is done."""


class ImageRunError(CallError, RuntimeError):
    """A prompts file that gives no prompt, an output folder made by another run, or images that failed on
    some rank (the message says which). Every rank raises it alike, so that the command reports it once."""


__all__ = ["CallError", "CallSpecError", "CheckpointSaveError", "CheckpointShapeError", "FolderChangedError",
           "FolderError", "ImageRunError", "LoadError", "MissingComponentsError", "PipelineLoadError",
           "ReplicaLoadError", "UnknownKeywordError", "UntrustedClassError", "WeightsNotFoundError"]
