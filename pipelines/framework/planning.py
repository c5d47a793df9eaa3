"""Plan a pipeline's module components with `placement.plan`: its graph, its dtypes, pins for components passed
in already dispatched, and (with `call=`) the activation peak of each component for that call."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

from torch import nn

import placement
from placement.device_maps import is_single_device as _names_one_device
from placement.sizing import dtype_for, dtype_label
from placement.unit_order import record_module_order

from .calls import CallSpecError, family_calls, family_runs
from .components import PipelineComponentError, PipelineComponents
from .diffusers_pipeline import graph_edges as diffusers_graph_edges
from .diffusers_pipeline import module_components as diffusers_module_components
from .saved_plans import check_saved_plan, is_plan_path as _is_plan_path, nest_flat_device_map, saved_plan

# This library's three package folders: a frame whose file lies in one of them is not the user's.
_LIBRARY_DIRS = tuple(Path(__file__).resolve().parents[2] / name for name in ("placement", "hooks", "pipelines"))


def plan_pipeline(pipe, *, device_map, max_memory, torch_dtype, offload_folder, call, pinned: Mapping[str, Any],
                  modules: Mapping[str, nn.Module] | None = None, edges=None) -> placement.Plan:
    """`placement.plan` over the pipeline's module components with its model graph (and activations when
    `call` is given). `device_map` may also be a saved plan (a `Plan` or the path of its JSON: used as it is,
    after checking it fits these components) or a flat `hf_device_map` with dotted keys."""
    if modules is None:
        modules, edges = modules_and_edges(pipe)
    saved = saved_plan(device_map)
    if saved is not None:
        return check_saved_plan(saved, modules, torch_dtype)
    device_map = nest_flat_device_map(device_map, modules)
    activations, module_order = None, {}
    if call is not None:
        activations = call_activations(pipe, modules, call, torch_dtype=torch_dtype, module_order=module_order)
    runs = call_runs(pipe, modules, call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = placement.plan(modules, max_memory=max_memory, strategy=device_map, graph=edges,
                              dtype=torch_dtype, offload_folder=offload_folder, activations=activations,
                              pinned=dict(pinned) or None, module_order=module_order or None, runs_per_call=runs)
    for warning in caught:  # pointed at the user's line (from_pretrained(...)), not at this library's insides
        warnings.warn(warning.message, warning.category, stacklevel=_caller_stacklevel())
    return plan if call is None else plan.with_inputs(call=dict(call))


def _caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this library (its three packages), for warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and any(Path(frame.f_code.co_filename).resolve().is_relative_to(d) for d in _LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def call_activations(pipe: PipelineComponents, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                     torch_dtype=None, module_order: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Peak activation bytes per component for one call, estimated on meta from example inputs: the
    pipeline's own (`activation_inputs(**call)` gives a call per component), else those of its diffusers
    family, looked up by class name (`calls.family_calls`; a component run several times counts its largest).
    When `module_order` is a dict, each component's submodule paths are recorded into it in the order that
    call runs them (splits are cut in it)."""
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        runs = family_calls(pipeline_class_name(pipe), modules, call)
    else:
        sizes = {key: value for key, value in call.items() if key != "num_inference_steps"}  # runs, not sizes
        try:
            runs = {name: [spec] for name, spec in describe(**sizes).items()}
        except TypeError as error:
            raise CallSpecError(
                f"call={dict(call)!r} does not fit {type(pipe).__name__}.activation_inputs: {error}. "
                "Give e.g. {'height': 1024, 'width': 1024, 'batch_size': 1}."
            ) from error
    peaks = {}
    for name, examples in runs.items():
        if name not in modules:
            continue
        with record_module_order(modules[name]) as order:
            peaks[name] = max(example.estimate(modules[name], dtype=dtype_for(torch_dtype, name)) for example in examples)
        if module_order is not None:
            module_order[name] = order
    return peaks


def call_runs(pipe, modules: Mapping[str, nn.Module], call: Mapping[str, Any] | None) -> dict[str, int] | None:
    """How many times each component runs per call (`placement.plan(runs_per_call=)`): the pipeline's own
    `runs_per_call(**call)`, else its diffusers family's (`calls.family_runs`: steps x passes per step), with
    the pipeline's defaults when `call` leaves them out (or is None); None when neither knows."""
    call = dict(call or {})
    describe = getattr(pipe, "runs_per_call", None)
    if describe is not None:
        try:
            runs = describe(**call)
        except TypeError as error:
            raise CallSpecError(f"call={call!r} does not fit {type(pipe).__name__}.runs_per_call: {error}.") from error
    else:
        runs = family_runs(pipeline_class_name(pipe), call)
    if runs is None and "num_inference_steps" in call:
        raise CallSpecError(
            f"call= gives num_inference_steps, but {pipeline_class_name(pipe)} does not say which component runs "
            "at each step: give its class a `runs_per_call(self, num_inference_steps=..., **call)` method "
            "returning {component: runs}, or pass runs_per_call= to placement.plan."
        )
    return None if runs is None else {name: count for name, count in runs.items() if name in modules}


def pipeline_class_name(pipe: PipelineComponents) -> str:
    """The pipeline class the folder names (a generic pipeline keeps model_index.json's `_class_name`)."""
    return getattr(pipe, "folder_class_name", None) or type(pipe).__name__


def is_single_device(device_map) -> bool:
    """A device_map naming one device ("cuda", "cuda:1", 0, "cpu", torch.device): everything there, no hooks."""
    if isinstance(device_map, (placement.Plan, Path)) or _is_plan_path(device_map):
        return False
    return _names_one_device(device_map)


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
