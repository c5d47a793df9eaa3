"""The middle of the error tree of `pipelines`: every subpackage's errors derive from one of these.

    placement.errors.PlacementError
    ├── FolderError        what a saved folder holds, or saving one: checkpoint files, model_index.json, classes
    ├── LoadError          a load or plan request that cannot be carried out (arguments, plans, devices)
    ├── CallError          a pipeline called with inputs it cannot take (prompts, sizes, schedulers, its VAE)
    └── DeviceMappedError  an operation that would move weights of a device-mapped pipeline or model

Each concrete error keeps its own `ValueError` / `RuntimeError` / ... base beside these (bad input vs a failure
while running), so `except ValueError` clauses keep working. This module sits below every subpackage (it imports
none of them); `pipelines.SomeError` (the package face) exports every concrete error by name.
"""

from placement.errors import PlacementError


class FolderError(PlacementError):
    """Base of the errors about a saved folder: its files, its model_index.json, its classes, saving it."""


class LoadError(PlacementError):
    """Base of the errors of a load or plan request that cannot be carried out as asked."""


class CallError(PlacementError):
    """Base of the errors of calling a pipeline (or one of its models, tokenizer, scheduler) with inputs it cannot
    take; raised before any work is done."""


class DeviceMappedError(PlacementError, RuntimeError):
    """An operation that would move weights (`.to()`, an offload method) on a device-mapped pipeline/model."""


__all__ = ["CallError", "DeviceMappedError", "FolderError", "LoadError"]
