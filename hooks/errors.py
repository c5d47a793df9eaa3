"""Typed errors of the runtime, under one stage base: a setting that cannot work (a `ValueError`: fix the
argument) and an operation refused because a placement holds the module's weights (a `RuntimeError`)."""

from placement.errors import PlacementError


class PlacementRuntimeError(PlacementError):
    """Base of every error raised while applying a placement or a memory technique to real modules."""


class OffloadConfigError(PlacementRuntimeError, ValueError):
    """A setting that cannot work: an offloading or casting option, a device map that cannot be applied, or a
    transfer plan that does not match its module."""


class OffloadConflictError(PlacementRuntimeError, RuntimeError):
    """An operation that would fight a placement over a module's weights (a second technique, `.to()`, an edit
    the placement cannot serve, a disk-homed weights file that changed under it); the message says what to do
    (`reset_device_map()` first, or load again)."""


__all__ = ["OffloadConfigError", "OffloadConflictError", "PlacementRuntimeError"]
