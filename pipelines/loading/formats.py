"""The load options of formats of their own (quantization, fp8 layerwise casting, pins), checked before anything
is built, and what each quantized format can do once placed: a planner input (`format_limits`), and checked
on the plan made (`check_planned_formats`).

What a format can do in our runtime (`_REFUSED`, tested in tests/pipelines/loading/test_quantized_offload.py):
- bitsandbytes: a 4-/8-bit weight is a `Params4bit`/`Int8Params` whose quantization state lives beside its
  data; moved whole with its module it stays valid (whole, split, the CPU), but offloading swaps tensors one by
  one and would keep the data without its state: any offloaded or disk placement is refused at plan time;
- torchao, quanto and GGUF tensors are tensor subclasses moved as they are (their inner int8/fp8 data and
  scales): whole, split, CPU, group-offloaded and per-call residency placements work (the last moves module
  groups as group offloading does), torchao's per-module streaming too; quanto's and GGUF's tensors cannot be
  rebuilt by accelerate's weight hooks (model-level maps mixing GPU and "cpu" without a transfer plan), and
  "disk" would write them to safetensors files, which hold plain tensors only: both refused at plan time.

Components read from a single-file checkpoint (`hf.single_file`): built on meta by diffusers' own single-file
path, read by its `from_single_file` (`WeightsReader.OWNER`) with the model's config from a local folder."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from hooks.layerwise_casting import apply_layerwise_casting
from hooks.techniques import PlanContext, follows_transfer_plan
from placement import FormatLimit
from placement.devices import is_accelerator
from placement.plan_schema import ComponentPlan, PlacementKind, Plan
from placement.sizing import tensor_format
from placement.sizes import format_bytes

from ..checkpoint import find_weights
from ..checkpoint.files import pickle_files_in
from ..errors import LoadError
from ..folder.components import module_dtype
from ..folder.families import DIFFUSERS, family_of, weights_name_for
from ..folder.sources import ComponentSource
from ..hf.owner_loading import OwnerLoad, load_without_device_map
from ..hf.quantizers import (
    ComponentQuantization,
    QuantizationMethod,
    component_quantization,
    format_label,
    method_of,
    requested_names,
    requested_quantization,
)
from ..hf.single_file import (
    build_on_meta,
    checkpoint_float_dtype,
    gguf_quantization,
    holds_component,
    is_gguf,
    meta_checkpoint,
)
from .meta import MetaComponent, WeightsReader, casting_config, layerwise_label, with_layerwise_casting
from .request import LoadRequest


class Runtime(str, Enum):
    """How our runtime runs a placement, as far as formats care."""

    MOVED = "kept on its devices"
    GROUP_OFFLOADED = "offloaded"
    STREAMED = "streamed module by module"
    DISK = "on disk"


_SAFETENSORS_ONLY = "our disk offload writes safetensors files, which hold plain tensors only"
_REBUILT = ("per-module streaming (accelerate's weight hooks) rebuilds each served weight as a plain tensor of its "
            "class, which these tensors cannot be; offload it whole to host RAM instead")
_STATE_APART = "its packed weights and their quantization state cannot be offloaded apart"
# What each quantized format cannot do in our runtime (tested in tests/pipelines/loading/test_quantized_offload.py).
_REFUSED: dict[QuantizationMethod, dict[Runtime, str]] = {
    QuantizationMethod.BITSANDBYTES_4BIT: {Runtime.GROUP_OFFLOADED: _STATE_APART, Runtime.STREAMED: _STATE_APART,
                                           Runtime.DISK: _STATE_APART},
    QuantizationMethod.TORCHAO: {Runtime.DISK: _SAFETENSORS_ONLY},
    QuantizationMethod.QUANTO: {Runtime.STREAMED: _REBUILT, Runtime.DISK: _SAFETENSORS_ONLY},
    QuantizationMethod.GGUF: {Runtime.STREAMED: _REBUILT, Runtime.DISK: _SAFETENSORS_ONLY},
}
_REFUSED[QuantizationMethod.BITSANDBYTES_8BIT] = _REFUSED[QuantizationMethod.BITSANDBYTES_4BIT]
# The disk copy is written from the checkpoint as loaded, before the fp8 cast: served from it, the layers would
# compute at full precision (other numbers than the same plan in RAM) and move twice the bytes planned.
_REFUSED[QuantizationMethod.LAYERWISE_CASTING] = {
    Runtime.DISK: "its disk copy would hold the weights before the fp8 cast, so they would compute at full precision"}


def runtime_of(component: ComponentPlan, plan: Plan) -> Runtime:
    if component.kind is PlacementKind.DISK:
        return Runtime.DISK
    if component.kind is PlacementKind.OFFLOADED:
        if follows_transfer_plan(component, PlanContext(plan=plan)):
            # per-call residency (hooks/residency.py) moves module groups, tensors as they are, as group
            # offloading does, whatever part stays resident
            return Runtime.GROUP_OFFLOADED
        resident = any(is_accelerator(device) for device in component.device_map.values())
        return Runtime.STREAMED if resident else Runtime.GROUP_OFFLOADED
    return Runtime.MOVED


def check_format_options(request: LoadRequest, *, built: list[str], passed: list[str]) -> None:
    """Before anything is built: each option names components this load has (quantization: those read from
    the folder; layerwise casting: any module component; pins: those passed in)."""
    options, modules = request.options, built + passed
    quantized = requested_names(options.quantization_config)
    quantized_passed = [name for name in passed if name in quantized]
    if quantized_passed:
        raise LoadError(
            f"quantization_config names {quantized_passed}, which were passed in: a component passed in is placed "
            "as it is; quantize it yourself (its owner's quantizer) or let the load read it from the folder."
        )
    for option, named in (("quantization_config", quantized), ("layerwise_casting", options.layerwise_casting)):
        unknown = sorted(set(named) - set(modules))
        if unknown:  # a misspelt name would silently load that component as it is
            raise LoadError(
                f"{option} names {unknown}, which are not module components of this pipeline; its module "
                f"components are {sorted(modules)}."
            )
    stray = sorted(set(options.pin) - set(passed))
    if stray:
        raise LoadError(
            f"pin={list(options.pin)} names {stray}, which were not passed in; pin keeps a component you pass "
            f"(e.g. transformer=my_model) where it is. Passed in: {sorted(passed) or 'nothing'}."
        )


def load_modules_without_device_map(opened, request: LoadRequest) -> dict[str, nn.Module]:
    """No device_map: each module component loaded to the CPU by its own class (quantized by its owner when asked),
    with layerwise casting applied when asked."""
    loaded = {}
    for name, source in opened.modules.items():
        # checked as a placed load checks them (its weights are safetensors, or pickles only on the explicit
        # opt-in; its folder's and the requested quantization), then read by the owner
        if not (request.allow_pickle and pickle_files_in(source.folder, weights_name_for(source.cls))):
            find_weights(source.folder, weights_name=weights_name_for(source.cls), variant=request.options.variant)
        component_quantization(request.options.quantization_config, name, source.family, source.folder)
        config = requested_quantization(request.options.quantization_config, name, source.family)
        module = load_without_device_map(source.cls, source.folder, family=source.family, dtype=opened.dtypes[name],
                                         variant=request.options.variant, quantization_config=config)
        storage = request.options.layerwise_casting.get(name)
        if storage is not None:
            compute = opened.dtypes[name] or module_dtype(module)
            apply_layerwise_casting(module, casting_config(module, storage, compute))
        loaded[name] = module
    return loaded


Formats = Mapping[str, tuple[QuantizationMethod, str]]  # component -> (its format, the format in words)


def formats_of_metas(metas: Mapping[str, MetaComponent]) -> dict[str, tuple[QuantizationMethod, str]]:
    formats = {name: (meta.quantization.method, format_label(meta.quantization))
               for name, meta in metas.items() if meta.quantization is not None}
    formats.update({name: (QuantizationMethod.LAYERWISE_CASTING, layerwise_label(meta.layerwise_casting))
                    for name, meta in metas.items() if meta.layerwise_casting is not None})
    return formats


def formats_of_modules(modules: Mapping[str, nn.Module]) -> dict[str, tuple[QuantizationMethod, str]]:
    """The formats of modules quantized in memory (`pipelines.place`), read from their tensors."""
    formats = {}
    for name, module in modules.items():
        libraries = {found.library: found.label for t in module.parameters() if (found := tensor_format(t))}
        if "bitsandbytes" in libraries:
            formats[name] = (QuantizationMethod.BITSANDBYTES_4BIT, libraries["bitsandbytes"])
        elif libraries:
            library, label = next(iter(libraries.items()))
            method = {"torchao": QuantizationMethod.TORCHAO, "quanto": QuantizationMethod.QUANTO,
                      "gguf": QuantizationMethod.GGUF}.get(library, QuantizationMethod.OTHER)
            formats[name] = (method, label)
    return formats


def refused_components(plan: Plan, formats: Formats) -> dict[str, str]:
    """{component: why} for each quantized component planned where its format cannot run."""
    refused = {}
    for name, (method, label) in formats.items():
        component = plan.components.get(name)
        runtime = None if component is None else runtime_of(component, plan)
        why = None if component is None else _REFUSED.get(method, {}).get(runtime)
        if why is not None:
            refused[name] = (
                f"Component {name!r} ({label}, {format_bytes(component.bytes)}) is planned {runtime.value}, which "
                f"its format cannot do here: {why}. {_advice(name, runtime)}")
    return refused


def _advice(name: str, runtime: Runtime) -> str:
    if runtime is Runtime.DISK:
        return (f"Give it room in host RAM (a larger max_memory['cpu']) or on its accelerator, so that {name!r} "
                "is not offloaded to disk.")
    return (f"Give its accelerator room for it whole (a larger max_memory, or device_map pinning {name!r} to a GPU), "
            "or choose a format that offloads (torchao int8 offloads every way; fp8 layerwise casting too).")


def check_planned_formats(plan: Plan, formats: Formats) -> None:
    """A quantized component planned where its format cannot run is an error before any weight is read."""
    refused = refused_components(plan, formats)
    if refused:
        raise LoadError(next(iter(refused.values())))


_PLANNED_KINDS = {Runtime.GROUP_OFFLOADED: PlacementKind.OFFLOADED, Runtime.DISK: PlacementKind.DISK}


def format_limits(formats: Formats) -> dict[str, FormatLimit]:
    """The planner's input for each component whose format cannot run offloaded or on disk (`_REFUSED`): the
    search never proposes those placements. A plan the caller gives is only checked (`check_planned_formats`)."""
    limits = {}
    for name, (method, label) in formats.items():
        refused = {_PLANNED_KINDS[runtime]: why for runtime, why in _REFUSED.get(method, {}).items()
                   if runtime in _PLANNED_KINDS}
        if refused:
            limits[name] = FormatLimit(label=label, refused=refused,
                                       advice={kind: _advice(name, runtime) for runtime, kind in _PLANNED_KINDS.items()
                                               if kind in refused})
    return limits


def build_single_file_component(name: str, cls: type, path: Path, config_folder: Path, *,
                                dtype: torch.dtype | None, quantization_config: Any = None,
                                layerwise_casting: torch.dtype | None = None) -> MetaComponent:
    """Component `name` (a `cls`) as diffusers' `from_single_file(path, config=config_folder)` loads it, on meta;
    a GGUF file with diffusers' GGUF quantizer (its packed blocks kept, layers computing in `dtype`)."""
    if not family_of(cls).reads_single_files:
        raise LoadError(
            f"{path.name}: single-file checkpoints are read by diffusers for its own models; {cls.__name__} is not "
            "one. Load its folder instead."
        )
    requested = requested_quantization(quantization_config, name, DIFFUSERS)
    if is_gguf(path):
        if requested is not None:
            raise LoadError(f"{path.name} is quantized already (GGUF); leave quantization_config out for {name!r}.")
        load_dtype = dtype or torch.bfloat16
        quantization = gguf_quantization(load_dtype)
    else:
        load_dtype = dtype or checkpoint_float_dtype(path)
        quantization = None if requested is None else ComponentQuantization(
            config=requested, pre_quantized=False, method=method_of(requested))
    module = build_on_meta(cls, path, config_folder, dtype=load_dtype, quantization=quantization)
    owner = OwnerLoad(cls=cls, family=DIFFUSERS, source=path, dtype=load_dtype, quantization=quantization,
                      single_file_config=config_folder)
    meta = MetaComponent(name=name, module=module, family=DIFFUSERS, weights=None, dtype=dtype, load_dtypes={},
                         keep_in_fp32=(), tied_weights={}, reader=WeightsReader.OWNER, owner=owner)
    return with_layerwise_casting(meta, layerwise_casting)


def single_file_sources(sources: Mapping[str, ComponentSource], path: Path | None) -> set[str]:
    """The module components a pipeline's single file holds (tested on meta); a file holding none is an error."""
    if path is None:
        return set()
    checkpoint = meta_checkpoint(path)
    held = {name for name, source in sources.items()
            if source.family.reads_single_files and holds_component(source.cls, checkpoint, source.folder)}
    if not held:
        models = {name: source.cls.__name__ for name, source in sources.items()}
        raise LoadError(
            f"{path.name} holds the weights of none of this pipeline's diffusers models {models} (as saved, or in "
            "an original layout diffusers converts); check that config= is the pipeline this file belongs to."
        )
    return held


__all__ = ["build_single_file_component", "single_file_sources"]
