"""Runtime: applies a placement Plan to real modules (dispatch, offloading, casting, per-call residency) and
meters what it moves. Every technique is `apply_x(module, config) -> handle` (`handle.remove()`) and one row in
`TECHNIQUES`, declared and registered by its own file; this face imports every file of the package and exports
each row's config class, apply and remove function (`technique_face`), so a new technique is listed nowhere else.

    placed = hooks.apply_plan({"text_encoder": te, "transformer": dit, "vae": vae}, plan)
    with hooks.measure_transfers() as meter, hooks.trace_calls() as trace:
        pipe(...)
"""

from .dispatch import DiskWeights, dispatch, undispatch
from .editing import edit_placed_weights, refresh_placement, weight_homes
from .errors import OffloadConfigError, OffloadConflictError, PlacementRuntimeError
from .group_offload.offload import (GroupOffloadHook, GroupOffloadSession, OffloadType, group_offloading_fields,
                                    group_offloading_session)
from .input_moving import execution_place, resolve_execution_device
from .layerwise_casting import layerwise_casting_fields
from .model_offload import ModelOffloadChain
from .residency import DeviceCoordinator
from .techniques import OFFLOADING, TECHNIQUES, Handle, PlacedModules, PlanContext, Technique, TechniqueConfig
from .techniques import TechniqueSpec, apply_component_plan, apply_plan, apply_to_each, check_compatible
from .techniques import load_techniques, remove_technique, technique_face, technique_for, techniques_on
from .run_timing import RunTiming
from .trace import CallTrace, TraceEvent, trace_calls
from .transfer_meter import Traffic, TransferMeter, measure_transfers

load_techniques(__name__, __path__)
# Each technique's config class, apply_x and remove_x (GroupOffloadingConfig, apply_group_offloading, ...).
_TECHNIQUE_FACE = technique_face()
globals().update(_TECHNIQUE_FACE)

__all__ = [
    # placing a plan
    "PlacedModules", "apply_component_plan", "apply_plan", "DiskWeights", "dispatch", "undispatch",
    # editing placed modules in place (adapters): new tensors follow their layer
    "edit_placed_weights", "refresh_placement", "weight_homes",
    # the technique table
    "OFFLOADING", "TECHNIQUES", "Handle", "PlanContext", "Technique", "TechniqueConfig", "TechniqueSpec",
    "apply_to_each", "check_compatible", "remove_technique", "technique_for", "techniques_on",
    # the techniques: each row's config, apply and remove, and what some add
    *_TECHNIQUE_FACE, "GroupOffloadHook", "GroupOffloadSession", "OffloadType", "group_offloading_session",
    "ModelOffloadChain", "DeviceCoordinator",
    # diffusers' keyword spellings, devices
    "group_offloading_fields", "layerwise_casting_fields", "execution_place", "resolve_execution_device",
    # the transfer meter, the call trace
    "Traffic", "TransferMeter", "measure_transfers", "CallTrace", "TraceEvent", "trace_calls",
    # a placed run's first calls timed per component (pipe.placement_report())
    "RunTiming",
    # errors
    "OffloadConfigError", "OffloadConflictError", "PlacementRuntimeError",
]
