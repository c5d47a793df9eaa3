"""Typed errors of the user-facing layer."""

from placement.errors import PlacementError


class DeviceMappedError(PlacementError, RuntimeError):
    """An operation that would move weights (`.to()`, an offload method) on a device-mapped pipeline/model."""
