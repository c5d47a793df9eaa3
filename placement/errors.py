"""Typed errors of the planning layer (sizes, devices, dtypes, strategies, graphs, components, fitting).

Every error says what was wrong (quoting the input), the numbers involved, and what to do instead.
They subclass ValueError or RuntimeError so callers that already catch those keep working.
"""


class PlacementError(Exception):
    """Base of every error raised by pipeline-placement. Below it, one mid-level base per stage, so a caller can
    tell a bad plan request from a failed load or a runtime conflict:

        PlanError               placement: sizes, devices, dtypes, strategies, graphs, fitting, plan files
        PlacementRuntimeError   hooks: offload techniques, dispatch, transfer plans
        FolderError, LoadError  pipelines: what a folder holds; loading it (pipelines.errors)
        CallError               pipelines: calling a pipeline with inputs it cannot take (pipelines.errors)
    """


class PlanError(PlacementError):
    """Planning could not be done as asked: a bad size, device, dtype, strategy, graph or component argument,
    a placement that does not fit, an activation estimate that failed, a plan file this version cannot read."""


class InvalidSizeError(PlanError, ValueError):
    """A memory size (e.g. a `max_memory` value) that cannot be parsed."""


class InvalidDeviceError(PlanError, ValueError):
    """A device key or device spec that is not an accelerator index, "cpu" or "disk"."""


class InvalidDtypeError(PlanError, ValueError):
    """A `torch_dtype` that is not a floating dtype, None, or a {component: dtype, "default": dtype} dict."""


class StrategyError(PlanError, ValueError):
    """A strategy that is not supported, or a dict strategy that is inconsistent with the components."""


class GraphError(PlanError, ValueError):
    """A model graph that names unknown components, is malformed, or has a cycle other than a self-loop."""


class ComponentError(PlanError, ValueError):
    """A `components`, `activations` or `pinned` argument that does not describe the pipeline's modules."""


class OffloadFolderRequiredError(PlanError, ValueError):
    """A component can only be placed on disk, and no `offload_folder` was given. `problem`: the message's facts
    without its fixes (so that a caller that knows likelier ones, as the CLI does, can put them first)."""

    problem: str = ""


class DoesNotFitError(PlanError, ValueError):
    """A placement the caller asked for (a single device, a dict strategy) exceeds a device's budget, or a
    component fits nowhere at all (not even on disk)."""
