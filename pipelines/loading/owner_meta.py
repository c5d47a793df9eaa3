"""Components read by their owner library (`WeightsReader.OWNER`), built on meta the way the owner builds them,
so that the plan sizes exactly what the owner will load.

    module = the class built from config.json on meta (hf_interop.construct)
    dtype  = torch_dtype, else the checkpoint's own floating dtype; a quantizer may change it (bitsandbytes)
    quantizer.preprocess_model(module)           # the owner's quantized layers replace the dense ones
    every other floating meta tensor -> dtype    # fp32-kept modules stay float32
    each quantized weight put in its quantized form, on meta (hf.quantizers.materialize_on_meta)

The owner is then called with that dtype (`OwnerLoad`), so what it loads is what was sized.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from placement.quantized_sizing import is_quantized_tensor
from placement.sizing import kept_fp32_module_names

from ..checkpoint import WeightsIndex
from ..folder.sources import Family
from ..hf.owner_loading import OwnerLoad
from ..hf.quantizers import (
    ComponentQuantization,
    compute_dtype,
    materialize_on_meta,
    owner_quantizer,
    prepare_on_meta,
    quantized_parameter_names,
)
from .meta_records import MetaComponent, WeightsReader


def build_owner_component(name: str, module: nn.Module, *, cls: type, folder: Path, family: Family,
                          dtype: torch.dtype | None, variant: str | None, weights: WeightsIndex | None,
                          quantization: ComponentQuantization | None) -> MetaComponent:
    """`module` (built on meta from `folder`'s config) prepared as its owner prepares it, each tensor in the
    dtype and form it will load in; the `OwnerLoad` that loads it so."""
    if dtype is None:  # the checkpoint's dtype, read from the tensors the dense module has (not quantized states)
        load_dtype = (checkpoint_float_dtype(weights, names=set(module.state_dict(keep_vars=True)))
                      or checkpoint_float_dtype(weights))  # a renamed checkpoint shares no name with its module
    else:
        load_dtype = dtype
    if quantization is not None:
        quantizer = owner_quantizer(quantization, family, name=name)
        load_dtype = compute_dtype(quantizer, family, load_dtype)
        keep = sorted(kept_fp32_module_names(module, load_dtype)) if _quantizer_keeps_fp32(quantizer, family) else []
        files = None if weights is None else [str(path) for path in weights.files]
        prepare_on_meta(module, quantizer, family, dtype=load_dtype, keep_in_fp32=keep, checkpoint_files=files)
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


def _quantizer_keeps_fp32(quantizer, family: Family) -> bool:
    """diffusers keeps `_keep_in_fp32_modules` under a quantizer only when the quantizer says so."""
    return family is not Family.DIFFUSERS or bool(getattr(quantizer, "use_keep_in_fp32_modules", False))


def checkpoint_float_dtype(weights: WeightsIndex | None, names: set[str] | None = None) -> torch.dtype | None:
    """The floating dtype holding most of the checkpoint's bytes (what the owner loads it in when no dtype is
    asked for), among `names` when given (a pre-quantized checkpoint's scales may be float32 while its biases and
    norms are bfloat16); None without weights (configs only: the config's dtypes are kept)."""
    if weights is None:
        return None
    by_dtype: dict[torch.dtype, int] = {}
    for entry in weights.tensors.values():
        if entry.dtype.is_floating_point and (names is None or entry.name in names):
            by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


def cast_floating_meta(module: nn.Module, dtype: torch.dtype | None, *, keep_in_fp32: list[str] | tuple[str, ...]
                       ) -> None:
    """Every floating meta tensor that is not quantized to `dtype` (float32 in the kept modules). Free: meta.
    A parameter shared under several names (tied embeddings) stays one parameter."""
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


__all__ = ["build_owner_component", "cast_floating_meta", "checkpoint_float_dtype"]
