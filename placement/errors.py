"""Typed errors of the planning layer (sizes, devices, dtypes, strategies, graphs, components, fitting).

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


class StrategyError(PlacementError, ValueError):
    """A strategy that is not supported, or a dict strategy that is inconsistent with the components."""


class GraphError(PlacementError, ValueError):
    """A model graph that names unknown components, is malformed, or has a cycle other than a self-loop."""


class ComponentError(PlacementError, ValueError):
    """A `components`, `activations` or `pinned` argument that does not describe the pipeline's modules."""


class OffloadFolderRequiredError(PlacementError, ValueError):
    """A component can only be placed on disk, and no `offload_folder` was given."""


class DoesNotFitError(PlacementError, ValueError):
    """A placement the caller asked for (a single device, a dict strategy) exceeds a device's budget, or a
    component fits nowhere at all (not even on disk)."""
