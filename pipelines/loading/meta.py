"""The one meta builder: a component's module on meta, each tensor in the dtype (or quantized form, or fp8
layerwise-cast storage) it will load as, with every fact about its weights that planning and placing need,
worked out once (`MetaComponent`), so that the plan sizes exactly what the load reads."""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from hooks.layerwise_casting import CASTABLE_LAYERS, LayerwiseCastingConfig, apply_layerwise_casting
from placement.errors import PlanError
from placement.sizing import is_quantized_tensor
from placement.sizing import dtype_for, kept_fp32_module_names

from ..checkpoint import (
    CONFIG_NAME,
    WeightsIndex,
    WeightsNotFoundError,
    check_dtypes,
    find_weights,
    load_dtypes,
    tie_weights,
    validate_weights,
)
from ..checkpoint.files import read_config_dict
from ..folder.families import ModelFamily, family_of, weights_name_for
from ..folder.sources import ComponentSource
from ..hf.owner_loading import OwnerLoad, renames_explain
from ..hf.quantizers import (
    ComponentQuantization,
    component_quantization,
    materialize_on_meta,
    owner_quantizer,
    quantized_parameter_names,
)
from ..hf.single_file import largest_float_dtype
from .limits import BuildLimit, bounded_construction, check_repeat_counts, fewest_bits


class WeightsReader(Enum):
    """How a component's weights are read, chosen when it is built so planning and placing never guess: STREAM,
    our loader (each tensor from its safetensors file to its device); OWNER, the library that owns the format
    (renamed keys, quantized, single files), given our plan's map."""

    STREAM = "stream"
    OWNER = "owner"


@dataclass(frozen=True, kw_only=True)
class MetaComponent:
    """A module component built on meta and sized exactly, with what its load needs. `weights`: None without
    weight files (planning from configs); `tied_weights`: each tied parameter the checkpoint lacks -> its source."""

    name: str
    module: nn.Module
    family: ModelFamily
    weights: WeightsIndex | None
    dtype: torch.dtype | None
    load_dtypes: Mapping[str, torch.dtype]
    keep_in_fp32: tuple[str, ...]
    tied_weights: Mapping[str, str]
    reader: WeightsReader
    owner: OwnerLoad | None = None
    layerwise_casting: torch.dtype | None = None

    @property
    def quantization(self):
        return None if self.owner is None else self.owner.quantization

    @property
    def sizing_dtype(self) -> torch.dtype | None:
        """None under layerwise casting: the meta tensors hold every load dtype, and a requested dtype would size
        the fp8 weights at the compute dtype."""
        return None if self.layerwise_casting is not None else self.dtype

    @property
    def dtype_origin(self) -> str:
        if self.dtype is not None:
            return "torch_dtype"
        if self.weights is not None or (self.owner is not None and self.owner.single_file):
            return "checkpoint"
        return "config.json only, no weights read: give torch_dtype to plan for the checkpoint's dtype"


def build_owner_component(name: str, module: nn.Module, *, cls: type, folder: Path, family: ModelFamily,
                          dtype: torch.dtype | None, variant: str | None, weights: WeightsIndex | None,
                          quantization: ComponentQuantization | None) -> MetaComponent:
    """`module` prepared as its owner prepares it, each tensor in the dtype and form it will load in."""
    if dtype is None:  # the checkpoint's dtype, read from the tensors the dense module has (not quantized states)
        load_dtype = (checkpoint_float_dtype(weights, names=set(module.state_dict(keep_vars=True)))
                      or checkpoint_float_dtype(weights))  # a renamed checkpoint shares no name with its module
    else:
        load_dtype = dtype
    if quantization is not None:
        quantizer = owner_quantizer(quantization, family, name=name)
        load_dtype = family.compute_dtype(quantizer, load_dtype)
        keep = sorted(kept_fp32_module_names(module, load_dtype)) if family.keeps_fp32_under(quantizer) else []
        files = None if weights is None else [str(path) for path in weights.files]
        family.prepare_on_meta(module, quantizer, dtype=load_dtype, keep_in_fp32=keep, checkpoint_files=files)
        names = quantized_parameter_names(module, quantizer, family)
        cast_floating_meta(module, load_dtype, keep_in_fp32=keep)
        materialize_on_meta(module, quantization, names)
    else:
        keep = sorted(kept_fp32_module_names(module, load_dtype))
        cast_floating_meta(module, load_dtype, keep_in_fp32=keep)
    owner = OwnerLoad(cls=cls, family=family, source=Path(folder), dtype=load_dtype, quantization=quantization,
                      variant=variant)
    return MetaComponent(name=name, module=module, family=family, weights=weights, dtype=dtype, load_dtypes={},
                         keep_in_fp32=tuple(keep), tied_weights={}, reader=WeightsReader.OWNER, owner=owner)


def checkpoint_float_dtype(weights: WeightsIndex | None, names: set[str] | None = None) -> torch.dtype | None:
    """The floating dtype holding most of the checkpoint's bytes (what the owner loads it in), among `names` when
    given (a pre-quantized checkpoint's scales may be float32 while its biases and norms are bfloat16)."""
    return None if weights is None else largest_float_dtype(weights.tensors.values(), names)


def cast_floating_meta(module: nn.Module, dtype: torch.dtype | None, *, keep_in_fp32: list[str] | tuple[str, ...]
                       ) -> None:
    """Every floating, unquantized meta tensor to `dtype` (float32 in the kept modules); tied ones stay tied."""
    if dtype is None:
        return
    keep = set(keep_in_fp32)
    shared = _names_by_tensor(module)
    for tensor_name, tensor in list(named_module_tensors(module, include_buffers=True, recurse=True,
                                                         remove_non_persistent=True)):
        if tensor.device.type != "meta" or not tensor.is_floating_point() or is_quantized_tensor(tensor):
            continue
        target = torch.float32 if keep and not keep.isdisjoint(tensor_name.split(".")) else dtype
        if tensor.dtype != target:
            set_module_tensor_to_device(module, tensor_name, "meta", dtype=target)
            for other in shared.get(id(tensor), [])[1:]:  # the tied names take the re-typed parameter too
                owner, _, attribute = other.rpartition(".")
                setattr(module.get_submodule(owner), attribute, module.get_parameter(tensor_name))


def _names_by_tensor(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {key: value for key, value in names.items() if len(value) > 1}


# diffusers' `hooks.layerwise_casting.DEFAULT_SKIP_MODULES_PATTERN` (what `enable_layerwise_casting` skips).
DIFFUSERS_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def parse_layerwise_casting(layerwise_casting: Any) -> dict[str, torch.dtype]:
    if layerwise_casting is None:
        return {}
    if not isinstance(layerwise_casting, Mapping):
        raise PlanError(
            f"layerwise_casting={layerwise_casting!r}: give a dict {{component: storage dtype}}, e.g. "
            "{'transformer': torch.float8_e4m3fn}."
        )
    parsed = {}
    for name, value in layerwise_casting.items():
        try:
            dtype = dtype_for(value, str(name))
        except PlanError:  # its words are torch_dtype's: say it for layerwise_casting below
            dtype = None
        floating_bytes = dtype.itemsize if dtype is not None and dtype.is_floating_point else None
        if floating_bytes != 1:
            # Only fp8 storage works: a 16-bit one meets the compute dtype's inputs unconverted at the first call
            # ("mat1 and mat2 must have the same dtype"), and would save no more than torch_dtype does.
            half = " For 16-bit weights, load with torch_dtype=torch.bfloat16 instead." if floating_bytes == 2 else ""
            raise PlanError(
                f"layerwise_casting[{name!r}]={value!r}: the storage dtype must be an fp8 dtype, "
                f"torch.float8_e4m3fn or torch.float8_e5m2 (the weights are upcast per layer to compute).{half}"
            )
        parsed[str(name)] = dtype
    return parsed


def layerwise_label(storage: torch.dtype) -> str:
    return f"layerwise {str(storage).removeprefix('torch.')}"


def casting_config(module: nn.Module, storage: torch.dtype, compute: torch.dtype) -> LayerwiseCastingConfig:
    """The casting diffusers' `enable_layerwise_casting` would apply to `module`."""
    patterns = list(DIFFUSERS_SKIP_PATTERNS)
    patterns += list(getattr(module, "_skip_layerwise_casting_patterns", None) or ())
    patterns += [rf"(^|\.){name}($|\.)" for name in getattr(module, "_keep_in_fp32_modules", None) or ()]
    return LayerwiseCastingConfig(storage_dtype=storage, compute_dtype=compute, skip_modules_pattern=tuple(patterns))


def cast_tensor_names(module: nn.Module, config: LayerwiseCastingConfig) -> list[str]:
    """The floating parameters the casting stores small: those held directly by a castable, non-skipped layer."""
    names = []
    for path, layer in module.named_modules():
        if isinstance(layer, CASTABLE_LAYERS) and not config.skips(path, layer):
            prefix = f"{path}." if path else ""
            names += [prefix + name for name, tensor in layer.named_parameters(recurse=False)
                      if tensor.is_floating_point()]
    return names


def with_layerwise_casting(meta: MetaComponent, storage: torch.dtype | None) -> MetaComponent:
    if storage is None:
        return meta
    compute = compute_dtype(meta)
    # Sized as its meta tensors are (`MetaComponent.sizing_dtype`): the layers not cast hold the compute dtype
    # (already so when weights were read for planning; built from a config only they are still the config's).
    cast_floating_meta(meta.module, meta.dtype, keep_in_fp32=meta.keep_in_fp32)
    names = cast_tensor_names(meta.module, casting_config(meta.module, storage, compute))
    for name in names:
        set_module_tensor_to_device(meta.module, name, "meta", dtype=storage)
    load_dtypes = {**meta.load_dtypes, **{name: storage for name in names if name in meta.load_dtypes}}
    return dataclasses.replace(meta, load_dtypes=load_dtypes, layerwise_casting=storage)


def compute_dtype(meta: MetaComponent) -> torch.dtype:
    if meta.owner is not None and meta.owner.dtype is not None:
        return meta.owner.dtype
    return meta.dtype or checkpoint_float_dtype(meta.weights) or torch.float32


def apply_casting(module: nn.Module, meta: MetaComponent) -> None:
    if meta.layerwise_casting is not None:
        apply_layerwise_casting(module, casting_config(module, meta.layerwise_casting, compute_dtype(meta)))


@contextlib.contextmanager
def computing_on_meta(metas: Mapping[str, MetaComponent]) -> Iterator[None]:
    """For activation estimates: the cast layers' meta tensors back in their compute dtype (a matmul of bf16
    inputs with fp8 weights cannot run, on meta or anywhere; at run time each layer is upcast first)."""
    changed = []
    for meta in metas.values():
        if meta.layerwise_casting is None:
            continue
        compute = compute_dtype(meta)
        for name in cast_tensor_names(meta.module, casting_config(meta.module, meta.layerwise_casting, compute)):
            set_module_tensor_to_device(meta.module, name, "meta", dtype=compute)
            changed.append((meta.module, name, meta.layerwise_casting))
    try:
        yield
    finally:
        for module, name, storage in changed:
            set_module_tensor_to_device(module, name, "meta", dtype=storage)


__all__ = ["DIFFUSERS_SKIP_PATTERNS", "apply_casting", "casting_config", "cast_tensor_names", "computing_on_meta",
           "layerwise_label", "parse_layerwise_casting", "with_layerwise_casting"]


def build_component(name: str, cls: type, folder: Path, *, dtype: torch.dtype | None, variant: str | None,
                    weights_required: bool, family: ModelFamily | None = None, quantization_config: Any = None,
                    layerwise_casting: torch.dtype | None = None, limit: BuildLimit | None = None) -> MetaComponent:
    """`cls` built on meta from `folder` (config.json and safetensors headers only), each tensor in its load
    dtype. Keys and shapes are checked for every component about to be loaded (and always where its family says).
    A quantized component, or a checkpoint whose keys its owner renames on load, is read by its owner. `family`:
    the class's own (`family_of(cls)`) unless the caller resolved it already."""
    family = family or family_of(cls)
    quantization = component_quantization(quantization_config, name, family, folder)
    bits = fewest_bits(dtype, quantized=quantization is not None, layerwise=layerwise_casting is not None)
    with init_empty_weights(), _no_init_of_meta_tensors(), _within(name, folder, limit, bits=bits):
        module = family.construct(cls, folder)
    family.retie(module)  # init_empty_weights() breaks the constructor's ties
    module.eval()
    weights = _find_weights(cls, folder, variant=variant, required=weights_required)
    if quantization is not None or _renamed_on_load(module, family, weights):
        meta = build_owner_component(name, module, cls=cls, folder=folder, family=family, dtype=dtype,
                                     variant=variant, weights=weights, quantization=quantization)
    else:
        meta = _build_streamed(name, module, family, weights, dtype=dtype, weights_required=weights_required)
    return with_layerwise_casting(meta, layerwise_casting)


@contextmanager
def _within(name: str, folder: Path, limit: BuildLimit | None, *, bits: int) -> Iterator[None]:
    """A folder without config.json fails in `construct` with its own message."""
    if not (folder / CONFIG_NAME).is_file():
        yield
        return
    config = read_config_dict(folder)
    check_repeat_counts(name, folder / CONFIG_NAME, config)
    with bounded_construction(name, folder / CONFIG_NAME, config, limit, bits=bits):
        yield


def _build_streamed(name: str, module: nn.Module, family: ModelFamily, weights: WeightsIndex | None, *,
                    dtype: torch.dtype | None, weights_required: bool) -> MetaComponent:
    keep = tuple(sorted(kept_fp32_module_names(module, dtype)))
    ties: dict[str, str] = {}
    dtypes: dict[str, torch.dtype] = {}
    if weights is not None:
        tensors = dict(module.state_dict(keep_vars=True))  # one walk of the module for every check below
        ties = _tied_weights(module, family, weights, tensors)
        if weights_required or family.checks_every_checkpoint:
            validate_weights(module, weights, tied_weights=ties, model_tensors=tensors)
        dtypes = load_dtypes(weights, dtype, keep)
        _cast_meta(module, weights, dtypes, tensors, dtype=dtype, keep_in_fp32=keep)
        tie_weights(module, ties)  # re-typing a tied meta tensor replaces it under one of its names only
    return MetaComponent(name=name, module=module, family=family, weights=weights, dtype=dtype, load_dtypes=dtypes,
                         keep_in_fp32=keep, tied_weights=ties, reader=WeightsReader.STREAM)


def _renamed_on_load(module: nn.Module, family: ModelFamily, weights: WeightsIndex | None) -> bool:
    """A transformers checkpoint saved under its original key names, which transformers renames when loading."""
    if not family.renames_checkpoint_keys or weights is None:
        return False
    tensors = module.state_dict(keep_vars=True)
    if set(tensors) <= set(weights.tensors):
        return False
    ties = _tied_weights(module, family, weights, tensors)
    if set(tensors) - set(ties) <= set(weights.tensors):
        return False
    tied = {name for names in _names_by_tensor(module).values() for name in names}  # any may be absent
    return renames_explain(module, weights.tensors, allowed_missing=tied)


def build_from_source(source: ComponentSource, *, dtype: torch.dtype | None, variant: str | None,
                      weights_required: bool, quantization_config: Any = None,
                      layerwise_casting: torch.dtype | None = None, limit: BuildLimit | None = None) -> MetaComponent:
    return build_component(source.name, source.cls, source.folder, family=source.family, dtype=dtype,
                           variant=variant, weights_required=weights_required, quantization_config=quantization_config,
                           layerwise_casting=layerwise_casting, limit=limit)


# The torch.nn.init functions modules call from their constructors (`reset_parameters`).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextmanager
def _no_init_of_meta_tensors() -> Iterator[None]:
    """`torch.nn.init` returns a meta tensor untouched: initialising it computes nothing but costs a third of
    building a large model. Tensors with data (buffers) are initialised as usual."""
    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}

    def skipping(original: Callable) -> Callable:
        def init(tensor, *args, **kwargs):
            return tensor if tensor.is_meta else original(tensor, *args, **kwargs)
        return init

    for name, original in originals.items():
        setattr(torch.nn.init, name, skipping(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.nn.init, name, original)


def _find_weights(cls: type, folder: Path, *, variant: str | None, required: bool) -> WeightsIndex | None:
    try:
        return find_weights(folder, weights_name=weights_name_for(cls), variant=variant)
    except WeightsNotFoundError:
        if required:
            raise
        return None


def _tied_weights(module: nn.Module, family: ModelFamily, weights: WeightsIndex,
                  tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{tied name: source name} for every parameter shared under several names whose checkpoint stores only one
    (T5's `encoder.embed_tokens.weight` -> `shared.weight`); our models' declared `_tied_weights_keys` as well."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in tensors.items():  # the state dict names a shared parameter under each of its names
        if isinstance(tensor, nn.Parameter):
            names_of.setdefault(id(tensor), []).append(name)
    ties = {}
    for names in names_of.values():
        sources = [name for name in names if name in weights.tensors]
        ties.update({name: sources[0] for name in names if sources and name not in weights.tensors})
    ties.update(family.declared_ties(module))
    return ties


def _cast_meta(module: nn.Module, weights: WeightsIndex, dtypes: Mapping[str, torch.dtype],
               tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None, keep_in_fp32: tuple[str, ...]) -> None:
    """Every meta tensor in the dtype it will be loaded as, after `check_dtypes`, so that sizing is exact."""
    check_dtypes(module, weights, dtype=dtype, keep_in_fp32=keep_in_fp32, model_tensors=tensors)
    for name, target in dtypes.items():
        tensor = tensors.get(name)
        if tensor is not None and tensor.device.type == "meta" and tensor.dtype != target:
            set_module_tensor_to_device(module, name, "meta", dtype=target)
