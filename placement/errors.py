"""Typed errors of the planning layer, and the root of every error of this library.

A type exists where a caller catches it; everything else is said by the message. The stage bases of bad input
are `ValueError`s, so callers that catch those keep working.
"""


class PlacementError(Exception):
    """Base of every error raised by pipeline-placement. Below it, one base per stage, so a caller can tell a bad
    plan request from a bad folder, a failed load or a runtime conflict:

        PlanError               placement: sizes, devices, dtypes, strategies, graphs, fitting, plan files
        PlacementRuntimeError   hooks: offload techniques, dispatch, transfer plans (hooks.errors)
        FolderError, LoadError  pipelines: what a folder holds; loading it (pipelines.errors)
        CallError               pipelines: calling a pipeline with inputs it cannot take (pipelines.errors)
    """


class PlanError(PlacementError, ValueError):
    """Planning could not be done as asked: a bad size, dtype, strategy, graph, component, activation call or
    replica argument, or a plan file this version cannot read. The message names the argument and the fix."""


class InvalidDeviceError(PlanError):
    """A device key or device spec that is not an accelerator index, "cpu" or "disk", or an accelerator this
    machine lacks. Its own type because callers catch it to say which argument named the device."""


class DoesNotFitError(PlanError):
    """The pipeline does not fit the budgets as asked: a single device or a dict strategy exceeds a budget, a
    component fits nowhere (not even on disk), or only the disk would hold it and no `offload_folder` was given.
    Its own type because "too big" is what callers handle (offer a dtype, more memory, offloading).

    `problem`: where the disk is the way out, the message's facts without its fixes, so that a caller that
    knows likelier fixes (the CLI) can put them first; "" otherwise."""

    problem: str = ""
