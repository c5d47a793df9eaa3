"""fp8 layerwise casting as a plan option: `layerwise_casting={"transformer": torch.float8_e4m3fn}`.

The castable layers (Linear/Conv, outside diffusers' skip patterns: position/patch embeddings, norms, `proj_in`,
`proj_out`, and the model's own `_skip_layerwise_casting_patterns` and fp32-kept modules) store their weights in
the small dtype; each is upcast to the compute dtype (the component's `torch_dtype`, else its checkpoint's) for
its own forward only (`hooks.layerwise_casting`). Planning sizes the stored bytes: the meta tensors of those
layers take the storage dtype, and our loader reads them straight into it (no full-precision copy; from a
checkpoint saved in another dtype than the compute one that is one rounding where diffusers, casting to
torch_dtype first, makes two); a component read by its owner is cast after its load. The load applies the casting hooks before the placement's
runtime (casting first, then offloading: the offloaded groups then hold the small dtype too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from hooks.layerwise_casting import CASTABLE_LAYERS, LayerwiseCastingConfig, apply_layerwise_casting
from placement.errors import PlanError
from placement.sizing import dtype_for

from .meta_records import MetaComponent
from .owner_meta import cast_floating_meta, checkpoint_float_dtype

# diffusers' `hooks.layerwise_casting.DEFAULT_SKIP_MODULES_PATTERN` (what `enable_layerwise_casting` skips).
DIFFUSERS_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def parse_layerwise_casting(layerwise_casting: Any) -> dict[str, torch.dtype]:
    """`{component: storage dtype}` (a dtype or its name, e.g. "float8_e4m3fn"); anything else is an error."""
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
    """The format in a plan's words: "layerwise float8_e4m3fn"."""
    return f"layerwise {str(storage).removeprefix('torch.')}"


def casting_config(module: nn.Module, storage: torch.dtype, compute: torch.dtype) -> LayerwiseCastingConfig:
    """The casting diffusers' `enable_layerwise_casting` would apply to `module`: its skip patterns, plus the
    model's own and its fp32-kept modules."""
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
    """`meta` with its castable layers' meta tensors (and their load dtypes) in `storage`, sized as stored."""
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
    """What the cast layers compute in: torch_dtype, else the checkpoint's floating dtype, else float32."""
    if meta.owner is not None and meta.owner.dtype is not None:
        return meta.owner.dtype
    return meta.dtype or checkpoint_float_dtype(meta.weights) or torch.float32


def apply_casting(module: nn.Module, meta: MetaComponent) -> None:
    """The casting hooks on a loaded component (weights already stored small are left as they are)."""
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
