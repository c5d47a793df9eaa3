"""Typed errors of the memory techniques (group offloading, layerwise casting, model/sequential offload)."""

from placement.errors import PlacementError


class OffloadConfigError(PlacementError, ValueError):
    """An offloading or casting setting that cannot work (bad device, stream without CUDA, bad dtype, ...)."""


class OffloadConflictError(PlacementError, RuntimeError):
    """Two techniques that would fight over the same weights, e.g. group offload on top of accelerate offload."""
