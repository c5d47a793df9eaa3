"""Runtime: applies a placement Plan to real modules (dispatch, offloading, casting, per-call residency) and
meters what it moves. Every technique is `apply_x(module, config) -> handle` (`handle.remove()`) and one row in
`TECHNIQUES`, registered by its own file when imported here.

    placed = hooks.apply_plan({"text_encoder": te, "transformer": dit, "vae": vae}, plan)
    with hooks.measure_transfers() as meter, hooks.trace_calls() as trace:
        pipe(...)
"""

from .dispatch import DeviceMapConfig, DiskWeights, apply_device_map, dispatch, undispatch
from .editing import edit_placed_weights, refresh_placement, weight_homes
from .errors import OffloadConfigError, OffloadConflictError, PlacementRuntimeError
from .group_offload.offload import (GroupOffloadHook, GroupOffloadingConfig, GroupOffloadSession, OffloadType,
                                    apply_group_offloading, group_offloading_fields, group_offloading_session,
                                    remove_group_offloading)
from .input_moving import execution_place, resolve_execution_device
from .layerwise_casting import LayerwiseCastingConfig, apply_layerwise_casting, layerwise_casting_fields
from .layerwise_casting import remove_layerwise_casting
from .model_offload import ModelOffloadChain, ModelOffloadConfig, apply_model_cpu_offload, remove_model_cpu_offload
from .residency import DeviceCoordinator, ResidencyConfig, apply_residency, remove_residency
from .sequential_offload import SequentialOffloadConfig, apply_sequential_cpu_offload, remove_sequential_cpu_offload
from .techniques import OFFLOADING, TECHNIQUES, Handle, PlacedModules, PlanContext, Technique, TechniqueSpec
from .techniques import apply_component_plan, apply_plan, apply_to_each, check_compatible, remove_technique
from .techniques import technique_for, techniques_on
from .run_timing import RunTiming
from .trace import CallTrace, TraceEvent, trace_calls
from .transfer_meter import Traffic, TransferMeter, measure_transfers

__all__ = [
    # placing a plan
    "PlacedModules", "apply_component_plan", "apply_plan", "DeviceMapConfig", "DiskWeights", "apply_device_map",
    "dispatch", "undispatch",
    # editing placed modules in place (adapters): new tensors follow their layer
    "edit_placed_weights", "refresh_placement", "weight_homes",
    # the technique table
    "OFFLOADING", "TECHNIQUES", "Handle", "PlanContext", "Technique", "TechniqueSpec", "apply_to_each",
    "check_compatible", "remove_technique", "technique_for", "techniques_on",
    # the techniques: config, apply, remove
    "GroupOffloadHook", "GroupOffloadingConfig", "GroupOffloadSession", "OffloadType", "apply_group_offloading",
    "group_offloading_session", "remove_group_offloading",
    "LayerwiseCastingConfig", "apply_layerwise_casting", "remove_layerwise_casting",
    "ModelOffloadChain", "ModelOffloadConfig", "apply_model_cpu_offload", "remove_model_cpu_offload",
    "SequentialOffloadConfig", "apply_sequential_cpu_offload", "remove_sequential_cpu_offload",
    "DeviceCoordinator", "ResidencyConfig", "apply_residency", "remove_residency",
    # diffusers' keyword spellings, devices
    "group_offloading_fields", "layerwise_casting_fields", "execution_place", "resolve_execution_device",
    # the transfer meter, the call trace
    "Traffic", "TransferMeter", "measure_transfers", "CallTrace", "TraceEvent", "trace_calls",
    # a placed run's first calls timed per component (pipe.placement_report())
    "RunTiming",
    # errors
    "OffloadConfigError", "OffloadConflictError", "PlacementRuntimeError",
]
