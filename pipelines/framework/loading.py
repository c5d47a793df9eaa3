"""Pipeline.from_pretrained / plan_placement: build on meta, plan, stream each tensor to its device, dispatch.

    folder -> model_index.json -> classes -> modules built on meta (+ components passed in)
           -> the pipeline object: `cls` through its constructor, or for `Pipeline` itself and a folder naming a
              diffusers pipeline class, that class (`diffusers_pipeline`; generic=True keeps the generic Pipeline)
           -> placement.plan (graph = the pipeline's model graph; passed dispatched components pinned)
           -> per component: weights streamed from safetensors to the planned devices -> hooks for its kind
           -> pipe.hf_device_map (flat) and each model's hf_device_map (relative)

A load that fails anywhere after the first tensor moved undoes everything: hooks removed, loaded weights back
to meta (memory freed), components passed in returned to where they were.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from hooks.dispatch import undispatch
from hooks.plan_dispatch import apply_component_plan
from placement.devices import accelerators_present, is_accelerator, torch_device
from placement.errors import InvalidDtypeError, PlacementError
from placement.plan_schema import Plan
from placement.sizing import dtype_for

from ..checkpoint import (
    WeightsNotFoundError,
    cast_meta,
    find_weights,
    stream_component,
    tie_weights,
)
from ..checkpoint.progress import load_progress
from ..hf.adapters import follow_adapters
from .hf_interop import (
    build_on_meta,
    keep_in_fp32_modules,
    load_without_device_map,
    tied_weights_for,
    weights_name_for,
)
from .model_index import ModelIndex
from .components import PipelineComponentError, PipelineComponents, is_generic
from .diffusers_pipeline import (
    MissingComponentsError,
    attach_reset,
    build_diffusers_pipeline,
    check_diffusers_components,
    diffusers_pipeline_class,
    is_diffusers_folder,
)
from .planning import is_single_device, label_dtypes, modules_and_edges, passed_pins, plan_pipeline
from .snapshot import read_snapshot
from .sources import (
    ComponentSource,
    check_constructor,
    component_sources,
    construct_pipeline,
    load_non_module,
    resolve_pipeline_folder,
)


class PipelineLoadError(PlacementError, RuntimeError):
    """A plan that cannot be carried out on this machine (e.g. it names an accelerator that is not here)."""


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """The arguments of `from_pretrained` / `plan_placement` (`progress` matters to loading only)."""

    device_map: Any
    max_memory: Mapping | None
    torch_dtype: Any
    variant: str | None
    offload_folder: str | Path | None
    call: Mapping[str, Any] | None
    progress: bool = True
    trust_remote_code: bool = False


def load_pipeline(cls: type, pretrained, *, passed: Mapping[str, Any], options: LoadOptions,
                  generic: bool = False):
    """The pipeline of `cls` (or, for `Pipeline` itself, of the diffusers class a diffusers folder names unless
    `generic`), each module streamed to the plan's devices; from one save (see `snapshot`): reloaded if the
    folder was saved over while it loaded."""
    folder = resolve_pipeline_folder(pretrained, weights=True)
    return read_snapshot(folder, lambda: _load_once(cls, folder, passed=passed, options=options, generic=generic),
                         discard=lambda pipe: _discard(pipe, passed))


def _load_once(cls: type, pretrained, *, passed: Mapping[str, Any], options: LoadOptions, generic: bool):
    index, target, sources = _open_folder(cls, pretrained, passed=passed, options=options, weights=True,
                                          generic=generic)
    components: dict[str, Any] = {name: load_non_module(s) for name, s in sources.items() if not s.is_module}
    modules = {name: s for name, s in sources.items() if s.is_module}
    if options.device_map is None:
        for name, source in modules.items():
            dtype = dtype_for(options.torch_dtype, name)
            components[name] = load_without_device_map(source.cls, source.folder, dtype=dtype, variant=options.variant)
        return _construct(target, index, {**components, **passed}, pretrained)

    components.update({name: build_sized_on_meta(source, torch_dtype=options.torch_dtype, variant=options.variant,
                                                 weights_required=True)
                       for name, source in modules.items()})
    pipe = _construct(target, index, {**components, **passed}, pretrained)
    plan = _plan(pipe, passed, options, sources)
    check_devices_exist(plan)
    materialize(pipe, plan, modules, passed, options)
    if not isinstance(pipe, PipelineComponents):
        attach_reset(pipe)
        if is_single_device(options.device_map):  # as diffusers: device_map="cuda" keeps .to() allowed
            pipe.hf_device_map = str(torch_device(next(iter(plan.components.values())).execution_device))
    return pipe


def plan_folder(cls: type, pretrained, *, passed: Mapping[str, Any], options: LoadOptions,
                generic: bool = False) -> Plan:
    """The plan `load_pipeline` would follow; every module built on meta, no weight read, nothing loaded."""
    folder = resolve_pipeline_folder(pretrained, weights=False)
    return read_snapshot(folder, lambda: _plan_once(cls, folder, passed=passed, options=options, generic=generic))


def _plan_once(cls: type, pretrained, *, passed: Mapping[str, Any], options: LoadOptions, generic: bool) -> Plan:
    try:
        index, target, sources = _open_folder(cls, pretrained, passed=passed, options=options, weights=False,
                                              generic=generic)
    except MissingComponentsError as error:
        # Planning needs the models only: a folder without, say, its tokenizer (configs-only planning) cannot be
        # built as its diffusers class, but plans the same as the generic pipeline of its components.
        warnings.warn(f"Planning without {error.missing} (not in the folder): {error}", UserWarning, stacklevel=4)
        index, target, sources = _open_folder(cls, pretrained, passed=passed, options=options, weights=False,
                                              generic=True)
    components = {
        name: build_sized_on_meta(s, torch_dtype=options.torch_dtype, variant=options.variant, weights_required=False)
        if s.is_module else load_non_module(s)
        for name, s in sources.items()
    }
    pipe = _construct(target, index, {**components, **passed}, pretrained)
    return _plan(pipe, passed, options, sources)


def _plan(pipe, passed: Mapping[str, Any], options: LoadOptions, sources: Mapping[str, ComponentSource]) -> Plan:
    """`plan_pipeline` for a pipeline built from a folder: components passed in keep their own dtype, and those
    already dispatched are pinned where they are; each component's plan says which dtype it assumed."""
    modules, edges = modules_and_edges(pipe)
    dtypes = _dtype_spec(modules, options.torch_dtype, passed)
    plan = plan_pipeline(pipe, device_map=options.device_map, max_memory=options.max_memory, torch_dtype=dtypes,
                         offload_folder=options.offload_folder, call=options.call, pinned=passed_pins(passed),
                         modules=modules, edges=edges)
    return label_dtypes(plan, modules, dtypes, {name: _dtype_origin(name, dtypes, sources, options.variant)
                                                for name in plan.components})


def _dtype_origin(name: str, dtypes: Mapping[str, Any], sources: Mapping[str, ComponentSource],
                  variant: str | None) -> str:
    """Where the dtype a component was sized at comes from, for the plan to state."""
    if name not in sources:
        return "passed in, as it is"
    if dtypes.get(name) is not None:
        return "torch_dtype"
    try:
        find_weights(sources[name].folder, weights_name=weights_name_for(sources[name].cls), variant=variant)
    except WeightsNotFoundError:
        return "config.json only, no weights read: give torch_dtype to plan for the checkpoint's dtype"
    return "checkpoint"


def _open_folder(cls: type, pretrained, *, passed: Mapping[str, Any], options: LoadOptions, weights: bool,
                 generic: bool) -> tuple[ModelIndex, type, dict[str, ComponentSource]]:
    """The folder's index, the class to build (`cls`, or the diffusers class a diffusers folder names) and
    the sources of the components not passed in, after every check that needs no module built."""
    folder = resolve_pipeline_folder(pretrained, weights=weights)
    index = ModelIndex.read(folder)
    target = _target_class(cls, index, generic)
    if target is cls:
        check_constructor(cls, index, passed, trust_remote_code=options.trust_remote_code)
    else:
        check_diffusers_components(target, index, passed)
    sources = component_sources(index, folder, skip=passed, trust_remote_code=options.trust_remote_code)
    check_dtype_keys(options.torch_dtype, sources, passed)
    return index, target, sources


def _target_class(cls: type, index: ModelIndex, generic: bool) -> type:
    """`Pipeline.from_pretrained` of a diffusers folder builds the diffusers class (unless `generic`)."""
    if not is_generic(cls):
        if generic:
            raise PipelineComponentError(
                f"generic=True loads a folder as the generic pipelines.Pipeline; {cls.__name__} is a pipeline "
                "class of its own: call pipelines.Pipeline.from_pretrained(folder, generic=True) instead."
            )
        return cls
    if generic or not is_diffusers_folder(index):
        return cls
    return diffusers_pipeline_class(index)


def _construct(target: type, index: ModelIndex, components: Mapping[str, Any], pretrained):
    if is_generic(target) or issubclass(target, PipelineComponents):
        return construct_pipeline(target, index, components)
    return build_diffusers_pipeline(target, index, components, name_or_path=str(pretrained))


def build_sized_on_meta(source: ComponentSource, *, torch_dtype, variant: str | None,
                        weights_required: bool) -> nn.Module:
    """The module on meta with each tensor in the dtype it will load as (the checkpoint's own unless
    `torch_dtype` says otherwise; fp32-kept modules stay fp32), so planning sizes it exactly. Reads the
    safetensors headers only. Without weight files (a configs-only folder, when planning) the config's dtypes
    and `torch_dtype` are used."""
    module = build_on_meta(source.cls, source.folder)
    try:
        weights = find_weights(source.folder, weights_name=weights_name_for(source.cls), variant=variant)
    except WeightsNotFoundError:
        if weights_required:
            raise
        return module
    ties = tied_weights_for(module, weights.tensors)
    dtype = dtype_for(torch_dtype, source.name)
    cast_meta(module, weights, dtype=dtype, keep_in_fp32=keep_in_fp32_modules(module, dtype))
    tie_weights(module, ties)  # re-typing a tied meta tensor replaces it under one of its names only
    return module


def check_dtype_keys(torch_dtype, sources: Mapping[str, ComponentSource], passed: Mapping[str, Any]) -> None:
    """A dict `torch_dtype` may name module components and "default" only: a misspelt key would otherwise
    be ignored without a word, loading that component in the default dtype."""
    if not isinstance(torch_dtype, Mapping):
        return
    modules = [name for name, s in sources.items() if s.is_module]
    modules += [name for name, value in passed.items() if isinstance(value, nn.Module)]
    unknown = sorted(str(key) for key in torch_dtype if key != "default" and key not in modules)
    if unknown:
        raise InvalidDtypeError(
            f"torch_dtype names {unknown}, which are not module components of this pipeline; its module "
            f"components are {sorted(modules)}. Fix the key(s), or use 'default' for every other component."
        )


def _dtype_spec(modules: Mapping[str, nn.Module], torch_dtype,
                passed: Mapping[str, Any]) -> dict[str, torch.dtype | None]:
    """Per module component: the requested dtype for what we load; passed components keep their own."""
    return {name: None if name in passed else dtype_for(torch_dtype, name) for name in modules}


def check_devices_exist(plan: Plan) -> None:
    present = accelerators_present()
    wanted = sorted({d for c in plan.components.values() for d in [*c.devices, c.execution_device]
                     if is_accelerator(d)})
    absent = [d for d in wanted if d >= present]
    if absent:
        raise PipelineLoadError(
            f"The plan puts components on accelerator(s) {absent}, but this machine has {present}. "
            "To see where a pipeline would go on other hardware, call plan_placement(...) instead; to load here, "
            "give max_memory only for the accelerators present; to run this plan's code paths on CPU-backed "
            "accelerators, set PLACEMENT_VIRTUAL_ACCELERATORS=N (a test mode)."
        )


def materialize(pipe: Any, plan: Plan, sources: Mapping[str, ComponentSource],
                 passed: Mapping[str, Any], options: LoadOptions) -> None:
    """Stream, move and dispatch every component of `pipe` (ours or a diffusers pipeline); on any failure undo
    all of it before re-raising."""
    single_device = is_single_device(options.device_map)
    touched: list[str] = []
    passed_origin = {name: _origin_device(obj) for name, obj in passed.items() if isinstance(obj, nn.Module)}
    # One bar in bytes for the whole load: what is read from the checkpoints (disk parts are served, not read).
    read_bytes = sum(b for name in sources for d, b in plan.components[name].placed_bytes.items() if d != "disk")
    try:
        with load_progress(read_bytes, enabled=options.progress):
            for name in plan.execution_order:
                component = plan.components[name]
                if component.pinned and name in passed and getattr(passed[name], "hf_device_map", None):
                    continue  # already dispatched by its owner: shown in the map, never moved
                module = pipe.components[name]
                touched.append(name)
                disk_weights = None
                if name in sources:
                    disk_weights = _stream_weights(module, sources[name], component, options)
                else:
                    _move_passed(name, module, component)
                if single_device:
                    module.hf_device_map = dict(component.device_map)
                else:
                    apply_component_plan(module, component, disk_weights=disk_weights)
        pipe.placement_plan = plan
        pipe.hf_device_map = plan.device_map
        follow_adapters(pipe)  # adapters loaded later follow their layer's placement
    except BaseException:
        _undo(pipe, touched, sources, passed_origin)
        raise


def _stream_weights(module: nn.Module, source: ComponentSource, component, options: LoadOptions):
    """Load the component's tensors straight to the plan's devices; the offload index for its disk part."""
    weights = find_weights(source.folder, weights_name=weights_name_for(source.cls), variant=options.variant)
    dtype = dtype_for(options.torch_dtype, source.name)
    keep = keep_in_fp32_modules(module, dtype)
    tied = tied_weights_for(module, weights.tensors)
    # The checkpoint's own files serve the disk part; a tied parameter is served under its tied name too.
    return stream_component(module, weights, component, dtype=dtype, keep_in_fp32=keep, tied_weights=tied,
                            progress=options.progress, label=source.name)


def _move_passed(name: str, module: nn.Module, component) -> None:
    """A plain component passed in: moved to the plan's devices (never cast: it is the caller's object)."""
    for path, device in sorted(component.device_map.items(), key=lambda item: len(item[0])):
        if device == "disk":
            raise PipelineLoadError(
                f"Component {name!r} was passed in and planned to 'disk', but its weights are not in a checkpoint "
                "file that disk offload could read; give the CPU a larger max_memory, or save and load it instead."
            )
        module.get_submodule(path).to(torch_device(device))


def _origin_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _discard(pipe: Any, passed: Mapping[str, Any]) -> None:
    """Free a pipeline loaded from a save that was replaced meanwhile (the components passed in are kept)."""
    loaded = [name for name, obj in pipe.components.items() if isinstance(obj, nn.Module) and name not in passed]
    _undo(pipe, loaded, set(loaded), {})


def _undo(pipe: Any, touched: list[str], sources, passed_origin) -> None:
    for name in touched:
        module = pipe.components[name]
        try:
            undispatch(module)
            if name in sources:
                module.to("meta")  # frees what was loaded; the pipeline object is discarded anyway
            else:
                module.to(passed_origin.get(name, torch.device("cpu")))
            if hasattr(module, "hf_device_map"):
                module.hf_device_map = None
        except Exception:  # best effort: the original error is what the caller needs to see
            continue
    pipe.hf_device_map = None
    pipe.placement_plan = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
