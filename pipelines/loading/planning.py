"""Plan module components with `placement.plan`: a pipeline's (its graph, its dtypes, pins for components passed
in already dispatched, and with `call=` the activation peak of each component for that call) or one model's."""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

from torch import nn

import placement
from placement.sizing import dtype_for, dtype_label
from placement.unit_order import record_module_order

from ..folder.components import PipelineComponentError, PipelineComponents
from ..hf.calls import CallSpecError, family_calls
from ..hf.diffusers_pipeline import graph_edges as diffusers_graph_edges
from ..hf.diffusers_pipeline import module_components as diffusers_module_components
from .request import DeviceMapKind, DeviceMapRequest, Scope
from .memory_techniques import PlannedCall, VaeOptions, attempt, component_peak, plan_with_vae_techniques
from .saved_plans import check_saved_plan, nest_flat_device_map

# This library's three package folders: a frame whose file lies in one of them is not the user's.
_LIBRARY_DIRS = tuple(Path(__file__).resolve().parents[2] / name for name in ("placement", "hooks", "pipelines"))


def plan_pipeline(pipe, *, device_map, max_memory, torch_dtype, offload_folder, call, pinned: Mapping[str, Any],
                  modules: Mapping[str, nn.Module] | None = None, edges=None) -> placement.Plan:
    """`placement.plan` over the module components of a pipeline already built (a preset, a pipeline on meta):
    its model graph, and activations when `call` is given. `device_map` is interpreted here (it may also be a
    saved plan: a `Plan` or the path of its JSON, used as it is after checking it fits these components, or a
    flat `hf_device_map` with dotted keys)."""
    if modules is None:
        modules, edges = modules_and_edges(pipe)
    return plan_modules(pipe, modules, edges=edges, device_map=DeviceMapRequest.interpret(device_map),
                        dtypes=torch_dtype, max_memory=max_memory, offload_folder=offload_folder, call=call,
                        pinned=pinned)


def plan_modules(pipe, modules: Mapping[str, nn.Module], *, edges, device_map: DeviceMapRequest, dtypes,
                 max_memory, offload_folder, call, pinned: Mapping[str, Any],
                 scope: Scope = Scope.PIPELINE) -> placement.Plan:
    """The plan of `modules` (of `pipe`, which describes its calls; None for one model) for a device map
    interpreted once: a saved plan is checked and followed, anything else planned by `placement.plan` at
    `scope`. `dtypes`: what `placement.plan(dtype=...)` takes, usually {component: dtype} resolved once.
    With `call`, each component's activation peak for that call is planned for, and a VAE whose decode does
    not fit is planned tiled or sliced (`memory_techniques`; `call={"vae_tiling": False}` forbids it)."""
    if device_map.kind is DeviceMapKind.SAVED_PLAN:
        return check_saved_plan(device_map.value, modules, dtypes)
    strategy = device_map.value
    if device_map.kind is DeviceMapKind.PINS and scope is Scope.PIPELINE:
        strategy = nest_flat_device_map(strategy, modules)
    elif device_map.kind is DeviceMapKind.PINS:
        strategy = dict(strategy)  # a model's {submodule: device}, as accelerate takes it
    module_order: dict[str, list[str]] = {}

    def plan_for(activations: Mapping[str, int] | None) -> placement.Plan:
        return placement.plan(modules, max_memory=max_memory, strategy=strategy, graph=edges, dtype=dtypes,
                              offload_folder=offload_folder, activations=activations, pinned=dict(pinned) or None,
                              module_order=module_order or None, scope=scope.value)

    if call is None:
        outcome = attempt(plan_for, None)
    else:
        options, sizes = VaeOptions.split(call)
        runs = component_calls(pipe, modules, sizes)
        activations = estimate_peaks(runs, modules, torch_dtype=dtypes, module_order=module_order,
                                     techniques=options.forced_for(modules, runs))
        outcome = plan_with_vae_techniques(
            plan_for, PlannedCall(runs=runs, modules=modules, dtypes=dtypes, sizes=sizes,
                                  describe=lambda smaller: component_calls(pipe, modules, smaller)),
            activations, options)
    for warning in outcome.warnings:  # pointed at the user's line (from_pretrained(...)), not at our insides
        warnings.warn(warning.message, warning.category, stacklevel=caller_stacklevel())
    plan = outcome.result()
    return plan if call is None else plan.with_inputs(call=dict(call))


def caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this library (its three packages), for warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


@functools.lru_cache(maxsize=None)
def _in_library(filename: str) -> bool:
    return any(Path(filename).resolve().is_relative_to(directory) for directory in _LIBRARY_DIRS)


def call_activations(pipe: PipelineComponents, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                     torch_dtype=None, module_order: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Peak activation bytes per component for one call, estimated on meta from example inputs (see
    `component_calls`; a component run several times counts its largest), with the VAE techniques `call`
    turns on (`vae_tiling=True`, `vae_slicing=True`). When `module_order` is a dict, each component's submodule
    paths are recorded into it in the order that call runs them (splits are cut in it)."""
    options, sizes = VaeOptions.split(call)
    runs = component_calls(pipe, modules, sizes)
    return estimate_peaks(runs, modules, torch_dtype=torch_dtype, module_order=module_order,
                          techniques=options.forced_for(modules, runs))


def component_calls(pipe: PipelineComponents, modules: Mapping[str, nn.Module],
                    call: Mapping[str, Any]) -> dict[str, list]:
    """What one call of the pipeline runs of each component: the pipeline's own description
    (`activation_inputs(**call)` gives a call per component), else that of its diffusers family, looked up by
    class name (`calls.family_calls`). `call` holds sizes only (`VaeOptions.split` takes the techniques out)."""
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        return {name: list(examples) for name, examples in
                family_calls(pipeline_class_name(pipe), modules, call).items()}
    sizes = {key: value for key, value in call.items() if key != "num_inference_steps"}  # runs, not sizes
    try:
        return {name: [spec] for name, spec in describe(**sizes).items()}
    except TypeError as error:
        raise CallSpecError(
            f"call={dict(call)!r} does not fit {type(pipe).__name__}.activation_inputs: {error}. "
            "Give e.g. {'height': 1024, 'width': 1024, 'batch_size': 1}."
        ) from error


def estimate_peaks(runs: Mapping[str, list], modules: Mapping[str, nn.Module], *, torch_dtype=None,
                   module_order: dict[str, list[str]] | None = None,
                   techniques: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Each component's largest activation peak over its calls (with `techniques[name]` on, if any)."""
    peaks = {}
    for name, examples in runs.items():
        if name not in modules:
            continue
        with record_module_order(modules[name]) as order:
            peaks[name] = component_peak(name, modules[name], examples, dtype_for(torch_dtype, name),
                                         (techniques or {}).get(name, ()))
        if module_order is not None:
            module_order[name] = order
    return peaks


def pipeline_class_name(pipe: PipelineComponents) -> str:
    """The pipeline class the folder names (a generic pipeline keeps model_index.json's `_class_name`)."""
    return getattr(pipe, "folder_class_name", None) or type(pipe).__name__


def passed_pins(passed: Mapping[str, Any]) -> dict[str, Any]:
    """Components passed in that already carry a device map: pinned where they are (their own hf_device_map)."""
    pins = {}
    for name, obj in passed.items():
        if not isinstance(obj, nn.Module):
            continue
        device_map = getattr(obj, "hf_device_map", None)
        hooked = any(hasattr(submodule, "_hf_hook") for submodule in obj.modules())
        if device_map:
            pins[name] = dict(device_map)
        elif hooked:
            raise PipelineComponentError(
                f"Component {name!r} was passed in with accelerate hooks but no hf_device_map, so where it runs "
                "is unknown; remove its hooks (accelerate.hooks.remove_hook_from_module(m, recurse=True)) or load "
                "it with its own device_map."
            )
    return pins


def modules_and_edges(pipe) -> tuple[dict[str, nn.Module], list[tuple[str, str]]]:
    """Module components in execution order and the model graph, of ours or of a diffusers pipeline."""
    if isinstance(pipe, PipelineComponents):
        return pipe.module_components, pipe.graph_edges
    modules = diffusers_module_components(pipe)
    return modules, diffusers_graph_edges(type(pipe), modules)


def label_dtypes(plan: placement.Plan, modules: Mapping[str, nn.Module], torch_dtype,
                 origins: Mapping[str, str]) -> placement.Plan:
    """The plan with each component's dtype stated with its origin, e.g. "bfloat16 (torch_dtype)",
    "float16 (checkpoint)", "float32 (config.json only: ...)"."""
    components = {
        name: component.model_copy(update={"dtype": dtype_label(
            modules[name], dtype_for(torch_dtype, name), origin=origins.get(name))})
        for name, component in plan.components.items()
    }
    return plan.model_copy(update={"components": components})
