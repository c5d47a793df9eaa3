"""The one meta builder: a component's module on meta, each tensor in the dtype it will load as, with every fact
about its weights that planning and placing need, worked out once (`MetaComponent`).

    with init_empty_weights(): module = construct(cls, folder)   # its family's constructor (`hf.hf_interop`)
    weights = find_weights(folder, ...)                           # each safetensors header read once per load
    validate keys and shapes; check dtypes; re-type each meta tensor to its load dtype; re-tie

Used for our `ModelMixin`s (a model load is a one-component load), diffusers and transformers models alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from placement.sizing import kept_fp32_module_names

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
from ..folder.sources import ComponentSource, Family, weights_name_for
from ..hf.hf_interop import construct, retie
from ..hf.owner_loading import renames_explain
from ..hf.quantizers import component_quantization
from .build_limits import BuildLimit, bounded_construction, check_repeat_counts, fewest_bits
from .layerwise import with_layerwise_casting
from .meta_records import MetaComponent, WeightsReader
from .owner_meta import build_owner_component


def build_component(name: str, cls: type, folder: Path, *, family: Family, dtype: torch.dtype | None,
                    variant: str | None, weights_required: bool, quantization_config: Any = None,
                    layerwise_casting: torch.dtype | None = None, limit: BuildLimit | None = None) -> MetaComponent:
    """`cls` built on meta from `folder`, each tensor in its load dtype (the checkpoint's own unless `dtype`
    says otherwise; fp32-kept modules stay fp32), so planning sizes it exactly. Reads config.json and the
    safetensors headers only. Without weight files (a configs-only folder, when not `weights_required`) the
    config's dtypes are kept. Keys and shapes are checked for every component about to be loaded, and for our
    own models always (their checkpoints must match exactly).

    The reader is chosen here: a quantized component (its folder's `quantization_config`, or
    `quantization_config=` naming it) and a transformers checkpoint whose keys transformers renames on load
    are prepared and read by their owner (`owner_meta`); everything else is streamed by our loader.
    `layerwise_casting`: a storage dtype (fp8) for the castable layers (`layerwise`). `limit`: all budgets of
    the load together; an absurd config is refused before it is built (`build_limits`)."""
    quantization = component_quantization(quantization_config, name, family, folder)
    bits = fewest_bits(dtype, quantized=quantization is not None, layerwise=layerwise_casting is not None)
    with init_empty_weights(), _no_init_of_meta_tensors(), _within(name, folder, limit, bits=bits):
        module = construct(cls, folder, family)
    retie(module, family)  # init_empty_weights() breaks the constructor's ties
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
    """Its config's counts checked, then the constructor run with every tensor it asks for counted against
    `limit` (`build_limits`); a folder without config.json fails in `construct` with its own message."""
    if not (folder / CONFIG_NAME).is_file():
        yield
        return
    config = read_config_dict(folder)
    check_repeat_counts(name, folder / CONFIG_NAME, config)
    with bounded_construction(name, folder / CONFIG_NAME, config, limit, bits=bits):
        yield


def _build_streamed(name: str, module: nn.Module, family: Family, weights: WeightsIndex | None, *,
                    dtype: torch.dtype | None, weights_required: bool) -> MetaComponent:
    keep = tuple(sorted(kept_fp32_module_names(module, dtype)))
    ties: dict[str, str] = {}
    dtypes: dict[str, torch.dtype] = {}
    if weights is not None:
        tensors = dict(module.state_dict(keep_vars=True))  # one walk of the module for every check below
        ties = _tied_weights(module, family, weights, tensors)
        if weights_required or family is Family.OWN:
            validate_weights(module, weights, tied_weights=ties, model_tensors=tensors)
        dtypes = load_dtypes(weights, dtype, keep)
        _cast_meta(module, weights, dtypes, tensors, dtype=dtype, keep_in_fp32=keep)
        tie_weights(module, ties)  # re-typing a tied meta tensor replaces it under one of its names only
    return MetaComponent(name=name, module=module, family=family, weights=weights, dtype=dtype, load_dtypes=dtypes,
                         keep_in_fp32=keep, tied_weights=ties, reader=WeightsReader.STREAM)


def _renamed_on_load(module: nn.Module, family: Family, weights: WeightsIndex | None) -> bool:
    """A transformers checkpoint saved under its original key names, which transformers renames when loading."""
    if family is not Family.TRANSFORMERS or weights is None:
        return False
    tensors = module.state_dict(keep_vars=True)
    if set(tensors) <= set(weights.tensors):
        return False
    ties = _tied_weights(module, family, weights, tensors)
    if set(tensors) - set(ties) <= set(weights.tensors):
        return False
    return renames_explain(module, weights.tensors, allowed_missing=_all_tied_names(module))


def _all_tied_names(module: nn.Module) -> set[str]:
    """Every name of a parameter shared under several names (any of them may be absent from a checkpoint)."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(tensor), []).append(name)
    return {name for names in names_of.values() if len(names) > 1 for name in names}


def build_from_source(source: ComponentSource, *, dtype: torch.dtype | None, variant: str | None,
                      weights_required: bool, quantization_config: Any = None,
                      layerwise_casting: torch.dtype | None = None, limit: BuildLimit | None = None) -> MetaComponent:
    """`build_component` of one component of a pipeline folder."""
    return build_component(source.name, source.cls, source.folder, family=source.family, dtype=dtype,
                           variant=variant, weights_required=weights_required, quantization_config=quantization_config,
                           layerwise_casting=layerwise_casting, limit=limit)


# The torch.nn.init functions modules call from their constructors (`reset_parameters`).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextmanager
def _no_init_of_meta_tensors() -> Iterator[None]:
    """`torch.nn.init` functions return a meta tensor untouched: initialising it computes nothing but still costs
    a third of building a large model (diffusers and transformers skip init the same way when they build on
    meta). Tensors with data (buffers, which `init_empty_weights` leaves on the CPU) are initialised as usual."""
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


def _tied_weights(module: nn.Module, family: Family, weights: WeightsIndex,
                  tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{tied name: source name} for every parameter shared under several names whose checkpoint stores only one
    of them (transformers' T5 `encoder.embed_tokens.weight` -> `shared.weight`), found from the module itself so
    it holds for every family; our models' declared `_tied_weights_keys` as well (re-tied even when a checkpoint
    stores both names)."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in tensors.items():  # the state dict names a shared parameter under each of its names
        if isinstance(tensor, nn.Parameter):
            names_of.setdefault(id(tensor), []).append(name)
    ties = {}
    for names in names_of.values():
        sources = [name for name in names if name in weights.tensors]
        ties.update({name: sources[0] for name in names if sources and name not in weights.tensors})
    if family is Family.OWN:
        ties.update(type(module)._tied_weights_keys or {})
    return ties


def _cast_meta(module: nn.Module, weights: WeightsIndex, dtypes: Mapping[str, torch.dtype],
               tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None, keep_in_fp32: tuple[str, ...]) -> None:
    """Give every meta tensor the dtype it will be loaded as, so that sizing (`compute_module_sizes`) is exact.
    Costs nothing (meta tensors hold no memory). `FolderError` first for a checkpoint tensor the model
    cannot take (`check_dtypes`)."""
    check_dtypes(module, weights, dtype=dtype, keep_in_fp32=keep_in_fp32, model_tensors=tensors)
    for name, target in dtypes.items():
        tensor = tensors.get(name)
        if tensor is not None and tensor.device.type == "meta" and tensor.dtype != target:
            set_module_tensor_to_device(module, name, "meta", dtype=target)

