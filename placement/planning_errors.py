"""Typed errors of `placement.plan()`: each quotes the input, gives the numbers, and says what to do."""

from .errors import PlacementError


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
