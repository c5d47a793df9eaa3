"""Plan a pipeline's module components with `placement.plan`: its graph, its dtypes, pins for components passed
in already dispatched, and (with `call=`) the activation peak of each component for that call."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

from torch import nn

import placement
from placement.planning_errors import StrategyError
from placement.sizing import dtype_for
from placement.strategies import StrategyKind, parse_strategy

from .calls import CallSpecError, family_calls
from .components import PipelineComponentError, PipelineComponents

# This library's three package folders: a frame whose file lies in one of them is not the user's.
_LIBRARY_DIRS = tuple(Path(__file__).resolve().parents[2] / name for name in ("placement", "hooks", "pipelines"))


def plan_pipeline(pipe: PipelineComponents, *, device_map, max_memory, torch_dtype, offload_folder, call,
                  pinned: Mapping[str, Any]) -> placement.Plan:
    """`placement.plan` over `pipe.module_components` with its model graph (and activations when `call` is given)."""
    modules = pipe.module_components
    activations = None
    if call is not None:
        activations = call_activations(pipe, modules, call, torch_dtype=torch_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = placement.plan(modules, max_memory=max_memory, strategy=device_map, graph=pipe.graph_edges,
                              dtype=torch_dtype, offload_folder=offload_folder, activations=activations,
                              pinned=dict(pinned) or None)
    for warning in caught:  # pointed at the user's line (from_pretrained(...)), not at this library's insides
        warnings.warn(warning.message, warning.category, stacklevel=_caller_stacklevel())
    return plan


def _caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this library (its three packages), for warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and any(Path(frame.f_code.co_filename).resolve().is_relative_to(d) for d in _LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def call_activations(pipe: PipelineComponents, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                     torch_dtype=None) -> dict[str, int]:
    """Peak activation bytes per component for one call, estimated on meta from example inputs: the
    pipeline's own (`activation_inputs(**call)` gives a call per component), else those of its diffusers
    family, looked up by class name (`calls.family_calls`; a component run several times counts its largest)."""
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        calls = family_calls(pipeline_class_name(pipe), modules, call)
        return {name: max(example.estimate(modules[name], dtype=dtype_for(torch_dtype, name)) for example in runs)
                for name, runs in calls.items() if name in modules}
    try:
        inputs = describe(**dict(call))
    except TypeError as error:
        raise CallSpecError(
            f"call={dict(call)!r} does not fit {type(pipe).__name__}.activation_inputs: {error}. "
            "Give e.g. {'height': 1024, 'width': 1024, 'batch_size': 1}."
        ) from error
    return {name: spec.estimate(modules[name], dtype=dtype_for(torch_dtype, name))
            for name, spec in inputs.items() if name in modules}


def pipeline_class_name(pipe: PipelineComponents) -> str:
    """The pipeline class the folder names (a generic pipeline keeps model_index.json's `_class_name`)."""
    return getattr(pipe, "folder_class_name", None) or type(pipe).__name__


def is_single_device(device_map) -> bool:
    """A device_map naming one device ("cuda", "cuda:1", 0, "cpu", torch.device): everything there, no hooks."""
    try:
        return parse_strategy(device_map).kind is StrategyKind.DEVICE
    except StrategyError:
        return False


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
