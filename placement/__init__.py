"""Pure planning: sizes, devices, the model graph, strategies and the Plan. Never loads weights."""

from .activations import estimate_activations
from .devices import Device, normalize_device
from .errors import InvalidDeviceError, InvalidSizeError, PlacementError
from .sizes import format_size, parse_size

__all__ = [
    "Device",
    "InvalidDeviceError",
    "InvalidSizeError",
    "PlacementError",
    "estimate_activations",
    "format_size",
    "normalize_device",
    "parse_size",
]
