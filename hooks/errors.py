"""Typed errors of the runtime (`hooks`): one mid-level base, `PlacementRuntimeError`, under `PlacementError`.

Each error also derives from the builtin that fits (ValueError for a setting or a plan that cannot work,
RuntimeError for a state that refuses the operation), so callers that catch those keep working.
"""

from placement.errors import PlacementError


class PlacementRuntimeError(PlacementError):
    """Base of every error raised while applying a placement or a memory technique to real modules."""


class OffloadConfigError(PlacementRuntimeError, ValueError):
    """An offloading or casting setting that cannot work (bad device, stream without CUDA, bad dtype, ...)."""


class OffloadConflictError(PlacementRuntimeError, RuntimeError):
    """Two techniques that would fight over the same weights, e.g. group offload on top of accelerate offload."""


class DispatchError(PlacementRuntimeError, ValueError):
    """A device map that cannot be applied: incomplete, disk entries without weights to serve, bad devices."""


class TransferPlanError(PlacementRuntimeError, ValueError):
    """A component's transfer plan (`ComponentTransfer`) that does not match its module or its device map:
    a listed module that does not exist or is not homed on the host, or a host-homed tensor in no list."""


__all__ = ["DispatchError", "OffloadConfigError", "OffloadConflictError", "PlacementRuntimeError",
           "TransferPlanError"]
