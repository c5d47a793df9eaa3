"""Pipeline.from_pretrained / plan_placement, and `pipelines.place` (a pipeline already built, placed as a load
would place it): request -> model_index.json -> each module built on meta -> the pipeline object -> one plan ->
each component's weights read to its devices -> the whole plan's runtime at once. A load that fails after the
first tensor moved undoes everything: hooks removed, loaded weights back to meta, components passed in returned."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from hooks.dispatch import DiskWeights, undispatch
from hooks.errors import OffloadConflictError
from hooks.hook_utils import add_hook_last
from hooks.input_moving import DeliverOutputsHook
from hooks.layerwise_casting import apply_layerwise_casting, remove_layerwise_casting
from hooks.techniques import apply_component_plan
import placement
from placement.device_maps import flatten_device_map
from placement.devices import Accelerators, detected_for_load, torch_device
from placement.plan_schema import ComponentPlan, Plan

from ..checkpoint import WeightsNotFoundError, find_weights
from ..checkpoint.streaming import load_progress
from ..errors import MissingComponentsError, PipelineLoadError
from ..folder.components import PipelineComponents, module_dtype, record_origins, remember_origins, with_undo_calls
from ..folder.model_index import ModelIndex, read_snapshot
from ..folder.families import weights_name_for
from ..folder.sources import ComponentSource, component_sources, load_non_module
from ..hf.adapters import check_adapter_loads, follow_adapters
from ..hf.diffusers_pipeline import attach_reset
from ..hf.loading_keywords import check_no_keywords_left
from ..hf.owner_saving import save_components_atomically
from ..hf.quiet import hf_libraries, quiet
from .assembly import check_components, construct, install_component, target_class
from .formats import (
    Formats,
    build_single_file_component,
    check_format_options,
    check_planned_formats,
    format_limits,
    formats_of_metas,
    formats_of_modules,
    load_modules_without_device_map,
    single_file_sources,
)
from .limits import BuildLimit
from .memory_techniques import apply_memory_techniques
from .meta import MetaComponent, build_from_source, casting_config, computing_on_meta
from .placing import (
    attach_plan_runtime,
    check_plan_devices,
    check_requested_devices,
    move_entries,
    place_component,
    read_component,
    unplace,
    write_disk_entries,
)
from .planning import (
    caller_stacklevel,
    component_origin,
    finish_plan,
    label_dtypes,
    modules_and_edges,
    passed_pins,
    planning_call,
    prepare_plan,
    with_measured_disk_speed,
    with_notes,
)
from .planning_progress import planning_progress
from .request import DeviceMapKind, LoadOptions, LoadRequest, Scope, check_saved_plan, resolve_request
from .run_check import start_run_check


# (component whose outputs travel, component whose device they are joined on)
TEXT_ENCODERS_JOINED = ("text_encoder", "text_encoder_2")


def deliver_joined_outputs(pipe: Any, plan: Plan) -> None:
    """SDXL's `encode_prompt` (every class with `StableDiffusionXLLoraLoaderMixin`) concatenates the outputs of
    its two text encoders before moving them: on two GPUs, `text_encoder` hands its outputs over on
    `text_encoder_2`'s device."""
    if not _joins_text_encoders(type(pipe)):
        return
    source, target = TEXT_ENCODERS_JOINED
    components = getattr(pipe, "components", {})
    if not all(isinstance(components.get(name), nn.Module) and name in plan.components for name in (source, target)):
        return
    source_device = plan.components[source].execution_device
    target_device = plan.components[target].execution_device
    if source_device != target_device:
        add_hook_last(components[source], DeliverOutputsHook(torch_device(target_device)))


def _joins_text_encoders(cls: type) -> bool:
    return any(base.__name__ == "StableDiffusionXLLoraLoaderMixin" for base in cls.__mro__)


def hook_inputs_of_pinned(module: nn.Module, component: ComponentPlan) -> bool:
    """Attach input-moving hooks to an unhooked pinned component; whether it did. Its owner's one-device map
    (`device_map={"": 1}`) has no hook, while a diffusers pipeline sends inputs on its execution device."""
    if any(hasattr(submodule, "_hf_hook") for submodule in module.modules()):
        return False
    owner_map = getattr(module, "hf_device_map", None)  # None: pinned on request (`pin=`), with no map of its own
    apply_component_plan(module, component)
    if owner_map is not None:
        module.hf_device_map = owner_map
    return True


def unhook_pinned(module: nn.Module) -> None:
    """Remove the hooks `hook_inputs_of_pinned` attached; the weights and the owner's map stay."""
    owner_map = getattr(module, "hf_device_map", None)
    undispatch(module)
    module.hf_device_map = owner_map


# Files that hold (or index) weights, whatever their format.
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf", "*.pt",
                 "*.pth", "*.ckpt")


def check_expected_weights(metas: Mapping[str, MetaComponent], sources: Mapping[str, ComponentSource], *,
                           variant: str | None, saved_here: bool) -> list[str]:
    """Refuse to plan a local folder missing weights where weights were expected (another component has weights,
    or the component's folder holds weight files of another kind): a plan is made for the load, which cannot
    happen, so its verdict would be half an answer. A folder without any weights is planned from its configs, as
    documented; the notes returned say which components a folder this library saved has lost (a configs-only copy
    of it, or weights all gone: the load will tell)."""
    others_have = any(meta.weights is not None for meta in metas.values())
    missing = {name: source for name, meta in metas.items() if (source := sources.get(name)) is not None
               and meta.weights is None and not (meta.owner is not None and meta.owner.single_file)}
    broken = [missing_weights_line(name, source.folder, source.cls, variant) for name, source in missing.items()
              if others_have or holds_weight_files(source.folder)]
    if broken:
        raise missing_weights_error(broken)
    if not saved_here:
        return []
    return [f"{missing_weights_line(name, source.folder, source.cls, variant)} The plan sized it from its "
            "config.json; loading it will fail until its weights are there." for name, source in missing.items()]


def missing_weights_line(name: str, folder: Path, cls: type, variant: str | None) -> str:
    return f"{name}: {why_missing(folder, cls, variant)}"


def missing_weights_error(lines: Sequence[str]) -> WeightsNotFoundError:
    which = "a component's weights are" if len(lines) == 1 else f"{len(lines)} components' weights are"
    return WeightsNotFoundError(
        f"This folder cannot load as it is: {which} missing. " + " ".join(lines) + " Restore them (download the "
        "folder or save the pipeline again): until then it can be neither loaded nor planned, as a plan is made for "
        "its load. A folder of configs only (no weights at all) is planned from its configs, as is a Hub id."
    )


def holds_weight_files(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


def why_missing(folder: Path, cls: type, variant: str | None) -> str:
    """The checkpoint reader's own words for the weights it cannot find in `folder`."""
    try:
        find_weights(folder, weights_name=weights_name_for(cls), variant=variant)
    except WeightsNotFoundError as error:
        return str(error)
    return f"no weights were read from {str(folder)!r}."


@dataclass(frozen=True, kw_only=True)
class OpenedFolder:
    """A pipeline folder after every check that needs no module built: its index, the class to build, the
    sources of the components not passed in, and each module component's dtype (resolved once)."""

    index: ModelIndex
    target: type
    sources: Mapping[str, ComponentSource]
    dtypes: Mapping[str, torch.dtype | None]

    @property
    def modules(self) -> dict[str, ComponentSource]:
        return {name: source for name, source in self.sources.items() if source.is_module}

    def non_modules(self) -> dict[str, Any]:
        """The tokenizers, schedulers, ... loaded by their own classes."""
        return {name: load_non_module(source) for name, source in self.sources.items() if not source.is_module}


def open_folder(cls: type, request: LoadRequest, passed: Mapping[str, Any], *, generic: bool) -> OpenedFolder:
    index = ModelIndex.read(request.folder)
    target = target_class(cls, index, generic)
    check_components(target, cls, index, passed, trust_remote_code=request.options.trust_remote_code)
    sources = component_sources(index, request.folder, skip=passed, trust_remote_code=request.options.trust_remote_code)
    modules = [name for name, source in sources.items() if source.is_module]
    passed_modules = [name for name, obj in passed.items() if isinstance(obj, nn.Module)]
    request.dtypes.check_names(modules + passed_modules, of="pipeline")
    check_format_options(request, built=modules, passed=passed_modules)
    return OpenedFolder(index=index, target=target, sources=sources,
                        dtypes={name: request.dtypes.for_component(name) for name in modules})


def build_components(opened: OpenedFolder, request: LoadRequest, *, weights_required: bool) -> dict[str, MetaComponent]:
    """Each module component on meta, from the load's single file where it holds that component, else its folder."""
    from_file = single_file_sources(opened.modules, request.single_file)
    options = request.options
    limit = BuildLimit.of(options.max_memory, options.offload_folder, accelerators=request.accelerators.count)
    return {name: build_single_file_component(name, source.cls, request.single_file, source.folder,
                                              dtype=opened.dtypes[name], quantization_config=options.quantization_config,
                                              layerwise_casting=options.layerwise_casting.get(name))
            if name in from_file else
            build_from_source(source, dtype=opened.dtypes[name], variant=options.variant,
                              weights_required=weights_required, quantization_config=options.quantization_config,
                              layerwise_casting=options.layerwise_casting.get(name), limit=limit)
            for name, source in opened.modules.items()}


def load_pipeline(cls: type, request: LoadRequest, *, passed: Mapping[str, Any], generic: bool = False):
    """The pipeline of `cls` (for `Pipeline` itself, the diffusers class its folder names unless `generic`), each
    module placed; reloaded if the folder was saved over while it loaded."""
    with quiet(preload=hf_libraries(request.folder)), detected_for_load(request.accelerators):
        return read_snapshot(request.folder, functools.partial(_load_once, cls, request, passed, generic),
                             discard=lambda pipe: _discard(pipe, passed))


def _load_once(cls: type, request: LoadRequest, passed: Mapping[str, Any], generic: bool):
    check_requested_devices(request.device_map, request.accelerators)
    opened = open_folder(cls, request, passed, generic=generic)
    components = opened.non_modules()
    if request.device_map.kind is DeviceMapKind.NONE:
        if request.single_file is None:
            components.update(load_modules_without_device_map(opened, request))
        else:  # each component read to the CPU by its reader (the file's by from_single_file)
            components.update({name: place_component(meta, None, accelerators=request.accelerators,
                                                     progress=request.options.progress)
                               for name, meta in build_components(opened, request, weights_required=True).items()})
        pipe = construct(opened.target, opened.index, {**components, **passed}, request.folder)
        save_components_atomically(pipe, opened.modules)  # diffusers' own saves write in place
        check_adapter_loads(pipe, opened.modules)  # a bad LoRA named as on a placed pipeline
        return pipe
    metas = build_components(opened, request, weights_required=True)
    modules = {name: meta.module for name, meta in metas.items()}
    pipe = construct(opened.target, opened.index, {**components, **modules, **passed}, request.folder)
    pins = passed_pins(passed, pin=request.options.pin)
    plan = with_measured_disk_speed(plan_components(pipe, request, metas, pins=pins), metas)
    check_plan_devices(plan, request.accelerators)
    place_pipeline(pipe, plan, metas, passed, request)
    if request.device_map.hooks:  # every placed run checks its plan: pipe.placement_report()
        planned = request.device_map.kind is not DeviceMapKind.SAVED_PLAN  # a saved plan is followed, not re-made
        start_run_check(pipe, plan, replan=functools.partial(plan_folder, cls, request, passed=passed, generic=generic)
                        if planned else None)
    if not isinstance(pipe, PipelineComponents):
        attach_reset(pipe)
        if request.device_map.kind is DeviceMapKind.SINGLE_DEVICE:  # as diffusers: "cuda" keeps .to() allowed
            execution = next(iter(plan.components.values())).execution_device
            pipe.hf_device_map = str(torch_device(execution, request.accelerators))
    save_components_atomically(pipe, opened.modules)
    return pipe


def plan_folder(cls: type, request: LoadRequest, *, passed: Mapping[str, Any], generic: bool = False) -> Plan:
    """The plan `load_pipeline` would follow; every module built on meta, no weight read, nothing loaded."""
    with quiet(preload=hf_libraries(request.folder)), detected_for_load(request.accelerators):
        return read_snapshot(request.folder, functools.partial(_plan_once, cls, request, passed, generic))


def _plan_once(cls: type, request: LoadRequest, passed: Mapping[str, Any], generic: bool) -> Plan:
    try:
        opened = open_folder(cls, request, passed, generic=generic)
    except MissingComponentsError as error:
        # Planning needs the models only: a folder without, say, its tokenizer (configs-only planning) cannot be
        # built as its diffusers class, but plans the same as the generic pipeline of its components.
        warnings.warn(f"Planning without {error.missing} (not in the folder): {error}", UserWarning,
                      stacklevel=caller_stacklevel())
        opened = open_folder(cls, request, passed, generic=True)
    metas = build_components(opened, request, weights_required=False)
    notes = [] if not request.local else (  # a Hub pipeline is planned from its configs alone, by design
        check_expected_weights(metas, opened.sources, variant=request.options.variant,
                               saved_here=opened.index.save_id is not None))
    modules = {name: meta.module for name, meta in metas.items()}
    pipe = construct(opened.target, opened.index, {**opened.non_modules(), **modules, **passed}, request.folder)
    return plan_components(pipe, request, metas, pins=passed_pins(passed, pin=request.options.pin), notes=notes)


def plan_components(pipe: Any, request: LoadRequest, metas: Mapping[str, MetaComponent], *,
                    pins: tuple[Mapping[str, Any], Sequence[str]], notes: Sequence[str] = (),
                    formats: Formats | None = None, passed_origin: str = "passed in, as it is") -> Plan:
    """The one plan of a pipeline's module components, whether loaded, planned (`from_pretrained` and
    `plan_placement` both call this) or placed as built: one `placement.plan` call, which chooses the VAE
    techniques and keeps each format where it runs. Components passed in keep their own dtype, and those already
    dispatched are pinned where they are (`pins`: `passed_pins`' answer); each component's dtype is labelled with
    its origin."""
    modules, edges = modules_and_edges(pipe)
    pins, pin_notes = pins
    formats = formats_of_metas(metas) if formats is None else formats
    dtypes = {name: metas[name].dtype if name in metas else None for name in modules}
    origins = {name: component_origin(metas[name]) if name in metas else passed_origin for name in modules}
    notes = [*pin_notes, *notes]  # the pins' notes first, as the plan says them
    options = request.options
    if request.device_map.kind is DeviceMapKind.SAVED_PLAN:  # followed as it is: checked, not planned
        plan = check_saved_plan(request.device_map.value, modules, dtypes)
    else:
        with planning_progress(enabled=options.progress):
            prepared = prepare_plan(
                pipe, modules, edges=edges, device_map=request.device_map, dtypes=dtypes,
                max_memory=options.max_memory, offload_folder=options.offload_folder, call=options.call, pinned=pins,
                estimating=functools.partial(computing_on_meta, metas), advise=metas, gpu=options.gpu,
                guidance_parallel=options.guidance_parallel,
                sizing_dtypes={name: metas[name].sizing_dtype if name in metas else None for name in modules},
                format_limits=format_limits(formats))
            with planning_call(prepared):
                plan = placement.plan(modules, **prepared.arguments)
        plan = finish_plan(plan, prepared)
    check_planned_formats(plan, formats)  # what the search cannot see (a given map, accelerate's weight hooks)
    return with_notes(label_dtypes(plan, modules, dtypes, origins), notes)


def place_pipeline(pipe: Any, plan: Plan, metas: Mapping[str, MetaComponent], passed: Mapping[str, Any],
                   request: LoadRequest) -> None:
    """Place every component of `pipe` (ours or a diffusers pipeline) as `plan` says: the ones built here read
    from their checkpoints, the ones passed in moved; on any failure undo all of it before re-raising."""
    touched: list[str] = []
    disk_weights: dict = {}  # what serves the "disk" parts of the components read here, by name
    hooked_pinned: list[nn.Module] = []
    origins = {name: _origin_device(obj) for name, obj in passed.items() if isinstance(obj, nn.Module)}
    as_it_was = record_origins(pipe.components, plan, passed)  # what reset_device_map() puts back
    # One bar in bytes for the whole load: what is read from the checkpoints (disk parts are served, not read).
    read_bytes = sum(b for name in metas for d, b in plan.components[name].placed_bytes.items() if d != "disk")
    hooks = request.device_map.hooks
    try:
        with load_progress(read_bytes, enabled=request.options.progress) as bar:
            for name in plan.execution_order:
                component = plan.components[name]
                if component.pinned and name in passed and (
                        getattr(passed[name], "hf_device_map", None) or name in request.options.pin):  # stays where it is
                    if hooks and hook_inputs_of_pinned(passed[name], component):  # placed by its owner: never moved
                        hooked_pinned.append(passed[name])
                    continue
                touched.append(name)
                if name in metas:  # its weights only (hooks=False records its map): the runtime comes below
                    _check_registered(pipe, metas[name])
                    module, disk_weights[name] = read_component(
                        metas[name], component, accelerators=request.accelerators, progress=request.options.progress,
                        offload_folder=request.options.offload_folder)
                    if module is not metas[name].module:  # read by its owner: its module replaces the meta one
                        install_component(pipe, name, module)
                    _read_up_to(bar, name, plan, metas)
                else:
                    disk_weights[name] = _move_passed(name, pipe.components[name], component, request.accelerators,
                                                      request.options.offload_folder)
            # The whole plan's runtime at once: the components on one accelerator share its per-call coordinator.
            attach_plan_runtime({name: pipe.components[name] for name in touched}, plan, hooks=hooks,
                                disk_weights=disk_weights)
            if hooks:
                deliver_joined_outputs(pipe, plan)
            as_it_was = with_undo_calls(as_it_was, apply_memory_techniques(pipe, plan))  # VAE tiling/slicing
        pipe.placement_plan = plan
        pipe.hf_device_map = plan.device_map
        remember_origins(pipe, as_it_was)
        if hooks:
            follow_adapters(pipe)  # adapters loaded later follow their layer's placement
    except BaseException:
        _undo(pipe, touched, metas, origins)
        for module in hooked_pinned:
            unhook_pinned(module)
        raise


def _read_up_to(bar, done: str, plan: Plan, metas: Mapping[str, MetaComponent]) -> None:
    """The bar at the planned bytes of every component read so far: the plan counts buffers no checkpoint holds
    (CLIP's `position_ids`) and an owner's own load reads without our bar, so the reads alone would stop short."""
    if bar.disable:  # nobody sees it (no terminal): tqdm counts nothing, so there is nothing to top up
        return
    order = [name for name in plan.execution_order if name in metas]
    done_bytes = sum(b for name in order[: order.index(done) + 1]
                     for d, b in plan.components[name].placed_bytes.items() if d != "disk")
    bar.update(max(0, min(done_bytes, bar.total) - bar.n))


def _check_registered(pipe: Any, meta: MetaComponent) -> None:
    if pipe.components.get(meta.name) is not meta.module:
        raise PipelineLoadError(
            f"{type(pipe).__name__}'s constructor did not register the {meta.name!r} module it was given (it holds "
            f"{type(pipe.components.get(meta.name)).__name__}), so its weights cannot be loaded into it; register "
            "the components as they are passed (self.register_components(...))."
        )


def _move_passed(name: str, module: nn.Module, component, accelerators: Accelerators,
                 offload_folder) -> DiskWeights | None:
    """A plain component passed in: moved to the plan's devices (never cast: it is the caller's object); its
    "disk" entries written to `offload_folder` and served from there, as for a component its owner reads (the
    planner plans the disk only with an offload_folder; reset_device_map() brings them back)."""
    flat = flatten_device_map(module, component.device_map)
    move_entries(module, flat, accelerators, to_cpu=True)
    return write_disk_entries(module, flat, name, offload_folder)


def _origin_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _discard(pipe: Any, passed: Mapping[str, Any]) -> None:
    """Free a pipeline loaded from a save that was replaced meanwhile (the components passed in are kept)."""
    loaded = [name for name, obj in pipe.components.items() if isinstance(obj, nn.Module) and name not in passed]
    _undo(pipe, loaded, {name: None for name in loaded}, {})


def _undo(pipe: Any, touched: list[str], loaded: Mapping[str, Any], origins: Mapping[str, torch.device]) -> None:
    for name in touched:
        try:  # what this load read goes back to meta (freed: the pipeline is discarded); a passed one back home
            unplace(pipe.components[name], to="meta" if name in loaded else origins.get(name, torch.device("cpu")))
        except Exception:  # best effort: the original error is what the caller needs to see
            continue
    pipe.hf_device_map = None
    pipe.placement_plan = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def place(pipe: Any, *, device_map="balanced", max_memory=None, call: Mapping[str, Any] | None = None,
          offload_folder: str | Path | None = None, layerwise_casting: Mapping[str, Any] | None = None,
          pin: Sequence[str] = (), **keywords: Any) -> Plan:
    """Plan `pipe`'s module components as they are, move and dispatch them; returns the plan (also
    `pipe.placement_plan`). `device_map` takes what `from_pretrained` takes. Refused on a pipeline device-mapped
    already. `layerwise_casting={"transformer": torch.float8_e4m3fn}` stores those weights in fp8 first;
    `pin=["transformer"]` keeps a component where it is."""
    check_no_keywords_left(keywords, entry=place, label="pipelines.place")
    if getattr(pipe, "hf_device_map", None) is not None:
        raise OffloadConflictError(
            f"{type(pipe).__name__} is device-mapped already (hf_device_map={pipe.hf_device_map}); call "
            "pipe.reset_device_map() before placing it again."
        )
    options = LoadOptions(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder, call=call,
                          progress=False, layerwise_casting=layerwise_casting, pin=pin)
    request = resolve_request(None, options, scope=Scope.PIPELINE)
    check_requested_devices(request.device_map, request.accelerators)
    modules, _ = modules_and_edges(pipe)
    check_format_options(request, built=[], passed=list(modules))
    pins = passed_pins(modules, pin=request.options.pin)  # before casting: its hooks are not a placement
    for name, storage in request.options.layerwise_casting.items():
        module = modules[name]
        apply_layerwise_casting(module, casting_config(module, storage, module_dtype(module)))

    try:
        with detected_for_load(request.accelerators):
            plan = plan_components(pipe, request, {}, pins=pins, formats=formats_of_modules(modules),
                                   passed_origin="as it is, placed by pipelines.place")
            check_plan_devices(plan, request.accelerators)
            place_pipeline(pipe, plan, {}, modules, request)
    except BaseException:
        for name in request.options.layerwise_casting:  # nothing half-done: the casting this call applied comes off
            remove_layerwise_casting(modules[name])
        raise
    if request.device_map.hooks:
        start_run_check(pipe, plan)
    if not isinstance(pipe, PipelineComponents):
        attach_reset(pipe)
    return plan
