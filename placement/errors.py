"""Typed errors of the planning layer.

Every error says what was wrong (quoting the input), the numbers involved, and what to do instead.
They subclass ValueError or RuntimeError so callers that already catch those keep working.
"""


class PlacementError(Exception):
    """Base of every error raised by pipeline-placement."""


class InvalidSizeError(PlacementError, ValueError):
    """A memory size (e.g. a `max_memory` value) that cannot be parsed."""


class InvalidDeviceError(PlacementError, ValueError):
    """A device key or device spec that is not an accelerator index, "cpu" or "disk"."""


class InvalidDtypeError(PlacementError, ValueError):
    """A `torch_dtype` that is not a floating dtype, None, or a {component: dtype, "default": dtype} dict."""
