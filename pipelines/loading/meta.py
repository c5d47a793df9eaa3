"""The one meta builder: a component's module on meta, each tensor in the dtype it will load as, with every fact
about its weights that planning and placing need, worked out once (`MetaComponent`).

    with init_empty_weights(): module = construct(cls, folder)   # its family's constructor (`hf.hf_interop`)
    weights = find_weights(folder, ...)                           # each safetensors header read once per load
    validate keys and shapes; check dtypes; re-type each meta tensor to its load dtype; re-tie

Used for our `ModelMixin`s (a model load is a one-component load), diffusers and transformers models alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from placement.sizing import kept_fp32_module_names

from ..checkpoint import (
    WeightsIndex,
    WeightsNotFoundError,
    check_dtypes,
    find_weights,
    load_dtypes,
    tie_weights,
    validate_weights,
)
from ..folder.component_classes import Family, weights_name_for
from ..folder.sources import ComponentSource
from ..hf.hf_interop import construct, retie


class WeightsReader(Enum):
    """How a component's weights are read into its meta module: chosen when it is built (`build_component`), so
    planning and placing never guess.

    STREAM is this library's loader: each tensor from its safetensors file straight to its planned device
    (`placing.place_component`). The next readers will belong to the owner libraries of formats we do not read
    ourselves (transformers models whose checkpoint keys are renamed on load, quantized components, single
    files, GGUF): their `from_pretrained` / `from_single_file` given our plan's device map.
    """

    STREAM = "stream"


@dataclass(frozen=True, kw_only=True)
class MetaComponent:
    """A module component built on meta and sized exactly, with what its load needs.

    `weights` is None when the folder has no weight files (planning from configs only). `load_dtypes` maps each
    checkpoint tensor to the dtype it loads as; `keep_in_fp32` names the submodules kept float32 at `dtype`
    (sizing's rule, so the plan and the load agree); `tied_weights` maps each tied parameter the checkpoint
    lacks to the tensor that serves it."""

    name: str
    module: nn.Module
    family: Family
    weights: WeightsIndex | None
    dtype: torch.dtype | None
    load_dtypes: Mapping[str, torch.dtype]
    keep_in_fp32: tuple[str, ...]
    tied_weights: Mapping[str, str]
    reader: WeightsReader

    @property
    def dtype_origin(self) -> str:
        """Where the dtype the component was sized at comes from, for the plan to state."""
        if self.dtype is not None:
            return "torch_dtype"
        if self.weights is not None:
            return "checkpoint"
        return "config.json only, no weights read: give torch_dtype to plan for the checkpoint's dtype"


def build_component(name: str, cls: type, folder: Path, *, family: Family, dtype: torch.dtype | None,
                    variant: str | None, weights_required: bool) -> MetaComponent:
    """`cls` built on meta from `folder`, each tensor in its load dtype (the checkpoint's own unless `dtype`
    says otherwise; fp32-kept modules stay fp32), so planning sizes it exactly. Reads config.json and the
    safetensors headers only. Without weight files (a configs-only folder, when not `weights_required`) the
    config's dtypes are kept. Keys and shapes are checked for every component about to be loaded, and for our
    own models always (their checkpoints must match exactly)."""
    with init_empty_weights(), _no_init_of_meta_tensors():
        module = construct(cls, folder, family)
    retie(module, family)  # init_empty_weights() breaks the constructor's ties
    module.eval()
    keep = tuple(sorted(kept_fp32_module_names(module, dtype)))
    weights = _find_weights(cls, folder, variant=variant, required=weights_required)
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
    # Every format read today is safetensors in our folder layout, read by our loader; the owner-library
    # formats will choose their reader here, from the family and the folder's files.
    return MetaComponent(name=name, module=module, family=family, weights=weights, dtype=dtype, load_dtypes=dtypes,
                         keep_in_fp32=keep, tied_weights=ties, reader=WeightsReader.STREAM)


def build_from_source(source: ComponentSource, *, dtype: torch.dtype | None, variant: str | None,
                      weights_required: bool) -> MetaComponent:
    """`build_component` of one component of a pipeline folder."""
    return build_component(source.name, source.cls, source.folder, family=source.family, dtype=dtype,
                           variant=variant, weights_required=weights_required)


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
    Costs nothing (meta tensors hold no memory). `CheckpointDtypeError` first for a checkpoint tensor the model
    cannot take (`check_dtypes`)."""
    check_dtypes(module, weights, dtype=dtype, keep_in_fp32=keep_in_fp32, model_tensors=tensors)
    for name, target in dtypes.items():
        tensor = tensors.get(name)
        if tensor is not None and tensor.device.type == "meta" and tensor.dtype != target:
            set_module_tensor_to_device(module, name, "meta", dtype=target)

