"""`pipelines.load_model` / `plan_model`: one model of any family (diffusers, transformers or ours), from a folder
or a single file, loaded as its own class and planned at model scope (accelerate's strategy names); and
ModelMixin.from_pretrained / plan_placement, a one-component load through the pipeline's functions."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from placement.devices import detect_accelerators
from placement.plan_schema import Plan

from ..checkpoint.files import CLASS_NAME_KEY, CONFIG_NAME, read_config_dict
from ..errors import LoadError
from ..folder.sources import HubOptions, foreign_model_folder, model_folder_class
from ..hf.loading_keywords import check_no_keywords_left, with_hub_keywords
from ..hf.owner_saving import save_atomically
from ..hf.quiet import hf_libraries, quiet
from ..hf.single_file import is_single_file
from .formats import build_single_file_component, check_planned_formats, formats_of_metas
from .limits import BuildLimit
from .meta import MetaComponent, build_component, computing_on_meta, parse_layerwise_casting
from .pipeline_loader import holds_weight_files, missing_weights_error, missing_weights_line
from .placing import check_plan_devices, check_requested_devices, place_component
from .planning import component_origin, label_dtypes, plan_modules, with_measured_disk_speed
from .request import DeviceMapKind, DeviceMapRequest, LoadOptions, LoadRequest, Scope, resolve_request


MODEL_PATTERNS = ["*.json", "*.safetensors"]


def load_model(pretrained: str | Path, *, device_map: Any = "auto", max_memory: Mapping | None = None,
               torch_dtype: Any = None, dtype: Any = None, quantization_config: Any = None,
               layerwise_casting: Any = None, offload_folder: str | Path | None = None, variant: str | None = None,
               config: str | Path | None = None, subfolder: str | None = None, progress: bool = True,
               hub: HubOptions = HubOptions(),
               **keywords: Any) -> nn.Module:
    """The model saved in `pretrained` (a folder, a Hub id, or a single file with `config=` the local folder of its
    config.json), as its own class, placed by our plan. `device_map`: accelerate's model-level strategies, a dict
    {submodule: device}, one device, or None (the CPU). `dtype`: diffusers' and transformers' newer spelling of
    `torch_dtype` (both only when they agree). `layerwise_casting`: one storage dtype (fp8). diffusers'
    download keywords go into `hub`; its other loading keywords are accepted or refused by name."""
    hub = _keywords(keywords, hub, entry=load_model)
    check_requested_devices(DeviceMapRequest.interpret(device_map), detect_accelerators())
    with quiet(preload=_libraries(pretrained, config, subfolder)):  # only our own bar and messages
        request, meta = _build(pretrained, device_map=device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                               dtype=dtype,
                               quantization_config=quantization_config, layerwise_casting=layerwise_casting,
                               offload_folder=offload_folder, variant=variant, config=config, subfolder=subfolder,
                               progress=progress, hub=hub, weights_required=True)
        return _place(meta, request, _plan)


def plan_model(pretrained: str | Path, *, device_map: Any = "auto", max_memory: Mapping | None = None,
               torch_dtype: Any = None, dtype: Any = None, quantization_config: Any = None,
               layerwise_casting: Any = None, offload_folder: str | Path | None = None, variant: str | None = None,
               config: str | Path | None = None, subfolder: str | None = None, hub: HubOptions = HubOptions(),
               **keywords: Any) -> Plan:
    """The plan `load_model` would follow with the same arguments; reads configs and headers only."""
    hub = _keywords(keywords, hub, entry=plan_model)
    with quiet(preload=_libraries(pretrained, config, subfolder)):
        request, meta = _build(pretrained, device_map=device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                               dtype=dtype,
                               quantization_config=quantization_config, layerwise_casting=layerwise_casting,
                               offload_folder=offload_folder, variant=variant, config=config, subfolder=subfolder,
                               progress=False, hub=hub, weights_required=False)
        if meta.weights is None and request.local and request.folder is not None \
                and holds_weight_files(request.folder):  # a shard gone, say: the load this plan is for cannot be
            raise missing_weights_error([missing_weights_line(meta.name, request.folder, type(meta.module),
                                                              request.options.variant)])
        return _plan(meta, request)


def _libraries(pretrained, config, subfolder) -> tuple[str, ...]:
    """The Hugging Face libraries the load imports, when its config folder is local (`quiet` preloads them)."""
    folder = Path(config if is_single_file(pretrained) and config is not None else pretrained)
    return hf_libraries(folder / subfolder if subfolder else folder)


def _build(pretrained, *, device_map, torch_dtype, config, subfolder, hub, weights_required, layerwise_casting,
           **options) -> tuple[LoadRequest, MetaComponent]:
    single = is_single_file(pretrained)
    patterns = [f"{subfolder}/{pattern}" if subfolder else pattern for pattern in MODEL_PATTERNS]
    options = LoadOptions(device_map=device_map, torch_dtype=torch_dtype, config=config, subfolder=subfolder,
                          **dataclasses.asdict(hub), **options)
    request = resolve_request(None if single else pretrained, options, scope=Scope.MODEL, allow_patterns=patterns)
    storage = _storage_dtype(layerwise_casting)
    if single:
        config_folder = _config_folder(Path(pretrained), config, subfolder)
        cls = model_folder_class(config_folder)
        name = cls.__name__
        meta = build_single_file_component(name, cls, Path(pretrained), config_folder,
                                           dtype=request.dtypes.for_component(name),
                                           quantization_config=request.options.quantization_config,
                                           layerwise_casting=storage)
        return request, meta
    cls = model_folder_class(request.folder)
    name = cls.__name__
    meta = build_component(name, cls, request.folder, dtype=request.dtypes.for_component(name),
                           variant=request.options.variant, weights_required=weights_required,
                           quantization_config=request.options.quantization_config, layerwise_casting=storage,
                           limit=BuildLimit.of(request.options.max_memory, request.options.offload_folder,
                                                accelerators=request.accelerators.count))
    return request, meta


def _keywords(keywords: Mapping[str, Any], hub: HubOptions, *, entry) -> HubOptions:
    hub, rest = with_hub_keywords(hub, keywords)
    check_no_keywords_left(rest, entry=entry, label=entry.__name__)
    return hub


def _storage_dtype(layerwise_casting: Any) -> torch.dtype | None:
    if layerwise_casting is None:
        return None
    return parse_layerwise_casting({"model": layerwise_casting})["model"]


def _config_folder(path: Path, config: str | Path | None, subfolder: str | None) -> Path:
    """The local folder holding the single file's model config.json (`config=`, or its `subfolder`)."""
    if config is None:
        raise LoadError(
            f"{path.name} is a single-file checkpoint: give config= the local folder of its model's config.json "
            "(e.g. the transformer/ folder of the pipeline it belongs to, saved or downloaded once), so that nothing "
            "is fetched from the Hub."
        )
    folder = Path(config) / subfolder if subfolder else Path(config)
    if not (folder / "config.json").is_file():
        raise LoadError(f"config={str(folder)!r} holds no config.json; give the model's own config folder.")
    return folder


def _plan(meta: MetaComponent, request: LoadRequest) -> Plan:
    plan = _plan_own(meta, request, estimating=lambda: computing_on_meta({meta.name: meta}), advise={meta.name: meta},
                     sizing_dtypes={meta.name: meta.sizing_dtype})
    plan = label_dtypes(plan, {meta.name: meta.module}, {meta.name: meta.dtype}, {meta.name: component_origin(meta)})
    check_planned_formats(plan, formats_of_metas({meta.name: meta}))  # one model: nothing else to move aside
    return plan


logger = logging.getLogger(__name__)


def plan_own_model(cls: type, request: LoadRequest) -> Plan:
    """The plan `load_own_model` would follow; reads config.json and the safetensors headers only."""
    return _plan_own(_build_own(cls, request, weights_required=False), request)


def load_own_model(cls: type, request: LoadRequest):
    """The model of `cls` saved in `request.folder`, every tensor streamed to its planned device (no device_map:
    to the CPU), with the runtime of its placement kind; nothing half-loaded escapes a failure."""
    check_requested_devices(request.device_map, request.accelerators)
    return _place(_build_own(cls, request, weights_required=True), request, _plan_own)


def _place(meta: MetaComponent, request: LoadRequest, planner: Callable[[MetaComponent, LoadRequest], Plan]):
    """The one model placed by `planner`'s plan (no device_map: read to the CPU, no plan), in eval mode."""
    options = request.options
    if request.device_map.kind is DeviceMapKind.NONE:
        module = place_component(meta, None, accelerators=request.accelerators, progress=options.progress)
        return save_atomically(module).eval()  # a diffusers/transformers model's own save writes in place
    plan = with_measured_disk_speed(planner(meta, request), {meta.name: meta})
    check_plan_devices(plan, request.accelerators)
    module = place_component(meta, plan.components[meta.name], accelerators=request.accelerators,
                             hooks=request.device_map.hooks, progress=options.progress,
                             offload_folder=options.offload_folder)
    module.placement_plan = plan
    return save_atomically(module).eval()


def _build_own(cls: type, request: LoadRequest, *, weights_required: bool) -> MetaComponent:
    name = cls.__name__
    foreign = foreign_model_folder(request.folder, cls)
    if foreign is not None:
        raise LoadError(
            f"{request.folder} holds a {foreign} (saved by its own library), not a {name}: load it with "
            "pipelines.load_model(folder, device_map=...), which returns the folder's own class placed by this "
            "library's planner."
        )
    request.dtypes.check_names([name], of=f"model (a {name})")
    _warn_on_other_class(cls, request.folder)
    return build_component(name, cls, request.folder, dtype=request.dtypes.for_component(name),
                           variant=request.options.variant, weights_required=weights_required)


def _plan_own(meta: MetaComponent, request: LoadRequest, **planning: Any) -> Plan:
    # As for a pipeline (and accelerate), `offload_folder` is what permits planning onto "disk"; nothing is
    # written there: the checkpoint's own safetensors files serve the disk-offloaded weights.
    return plan_modules(None, {meta.name: meta.module}, edges=None, device_map=request.device_map,
                        dtypes={meta.name: meta.dtype}, max_memory=request.options.max_memory,
                        offload_folder=request.options.offload_folder, call=None, pinned={}, scope=request.scope,
                        **planning)


def _warn_on_other_class(cls: type, folder: Path) -> None:
    saved = read_config_dict(folder).get(CLASS_NAME_KEY)
    if saved is not None and saved != cls.__name__:
        logger.warning("%s was saved by %s; loading it as %s.", folder / CONFIG_NAME, saved, cls.__name__)


__all__ = ["load_model", "plan_model"]
