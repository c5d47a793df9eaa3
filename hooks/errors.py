"""Typed errors of the runtime (`hooks`): one stage base, `PlacementRuntimeError`, under `PlacementError`.

Two types below it, because callers tell them apart: a setting or a plan that cannot work (a `ValueError`: fix
the argument), and an operation refused because a placement holds the module's weights (a `RuntimeError`: undo
the placement first).
"""

from placement.errors import PlacementError


class PlacementRuntimeError(PlacementError):
    """Base of every error raised while applying a placement or a memory technique to real modules."""


class OffloadConfigError(PlacementRuntimeError, ValueError):
    """A setting that cannot work: an offloading or casting option (bad device, stream without CUDA, bad dtype),
    a device map that cannot be applied, or a transfer plan that does not match its module."""


class OffloadConflictError(PlacementRuntimeError, RuntimeError):
    """An operation that would fight a placement over a module's weights: a second technique on top of another,
    `.to()` or an offload method on a device-mapped pipeline, an edit of weights the placement cannot serve, an
    adapter moved or fused where its layer is placed. The message says what to remove first
    (`reset_device_map()`)."""


__all__ = ["OffloadConfigError", "OffloadConflictError", "PlacementRuntimeError"]
