"""Bytes of a module at a requested dtype, and the units a device map may place independently.

Sizes come from `accelerate.utils.compute_module_sizes` (the accelerate-style `{"": total, "blocks": ...,
"blocks.0": ...}` dict every device-map tool speaks), corrected where accelerate is wrong for loading:

- a bool tensor takes one byte per element in memory; accelerate counts 1/8 byte (a bit);
- a floating tensor stored smaller than the requested dtype (an fp16 parameter loaded with fp32) is cast
  up when loaded; accelerate takes the smaller of the two sizes;
- a non-floating tensor (int, bool, complex) is never cast; accelerate casts complex ones;
- `_keep_in_fp32_modules` only ever applies to floating tensors; accelerate's `special_dtypes` would
  also "cast" an int64 buffer inside such a module to 4 bytes.

Quantized tensors (torchao, optimum-quanto, bitsandbytes, GGUF) count their real storage, never cast
(`quantized_sizing`); a plan labels such a component by its format ("nf4 (bitsandbytes), compute bfloat16").

Tied parameters are counted once (at their first name, as `named_parameters` yields them).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from accelerate.utils import compute_module_sizes
from accelerate.utils.modeling import dtype_byte_size, named_module_tensors
from torch import nn

from .errors import PlanError
from .quantized_sizing import is_quantized_tensor, quantization_label, storage_bytes


@dataclass(frozen=True, kw_only=True)
class SplitUnit:
    """One piece a device map may put on a device of its own: a `_no_split_modules` block, a leaf module
    outside those blocks, or a parameter/buffer held directly by a module that has children."""

    path: str
    bytes: int


@dataclass(frozen=True, kw_only=True)
class ComponentSize:
    total: int  # bytes at the requested dtype, as loaded
    module_sizes: dict[str, int]  # accelerate-style, corrected; keys are module and tensor paths
    split_units: tuple[SplitUnit, ...]  # in the order a split fills devices: execution order (see split_units)
    no_split_classes: tuple[str, ...]  # the blocks a split never cuts (`protected_classes`)
    declares_no_split: bool = True  # whether they are the module's own `_no_split_modules`

    @property
    def largest_unit(self) -> int:
        """The smallest room that can hold any piece of this module: its largest split unit."""
        return max((unit.bytes for unit in self.split_units), default=0)


def size_module(module: nn.Module, dtype: torch.dtype | None = None) -> ComponentSize:
    """Size `module` (usually on meta) as it will be once loaded with `torch_dtype=dtype`."""
    dtype = _resolve_dtype(dtype, where="size_module(dtype=...)")
    kept_fp32 = fp32_kept_tensors(module, dtype)
    sizes = compute_module_sizes(module, dtype=dtype, special_dtypes=kept_fp32 or None)
    for name, delta in _corrections(module, dtype, kept_fp32):
        parts = name.split(".")
        for idx in range(len(parts) + 1):
            sizes[".".join(parts[:idx])] += delta
    module_sizes = {key: int(round(value)) for key, value in sizes.items()}
    module_sizes.setdefault("", 0)
    declared = no_split_classes(module)
    no_split = declared or block_classes(module)
    return ComponentSize(
        total=module_sizes[""],
        module_sizes=module_sizes,
        split_units=split_units(module, module_sizes, no_split),
        no_split_classes=no_split,
        declares_no_split=bool(declared),
    )


def no_split_classes(module: nn.Module) -> tuple[str, ...]:
    """The module's `_no_split_modules` class names (None or absent means no block is protected)."""
    names = getattr(module, "_no_split_modules", None) or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(dict.fromkeys(str(name) for name in names))


def block_classes(module: nn.Module) -> tuple[str, ...]:
    """The classes of the blocks in `module`'s block lists (the children of a ModuleList or Sequential, found
    without looking inside a block): what a split keeps whole when the module declares no `_no_split_modules`.
    A block's forward mixes its own tensors with its submodules' outputs (FLUX's `gate_mlp * ff(x)`), so a cut
    inside one would meet two devices in one op; between blocks, only the blocks' inputs cross, and the input
    hooks move them."""
    found: list[str] = []

    def descend(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                found.extend(type(block).__name__ for block in child.children() if next(block.children(), None))
            else:
                descend(child)

    descend(module)
    return tuple(dict.fromkeys(found))


def fp32_kept_tensors(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """`{tensor path: torch.float32}` for the floating tensors that loading keeps in float32.

    diffusers (and this library's ModelMixin) keep `_keep_in_fp32_modules` in fp32 whatever `torch_dtype` is;
    transformers only does so when loading in fp16, and keeps `_keep_in_fp32_modules_strict` in fp32 for
    fp16 and bf16. A name matches when it is one dotted part of the tensor's path ("wo" in "block.0.wo.weight").
    """
    keep = kept_fp32_module_names(module, dtype)
    if not keep:
        return {}
    return {
        name: torch.float32
        for name, tensor in named_module_tensors(module, recurse=True)
        if tensor.is_floating_point() and not is_quantized_tensor(tensor) and not keep.isdisjoint(name.split("."))
    }


def split_units(module: nn.Module, module_sizes: Mapping[str, int], no_split: tuple[str, ...]) -> tuple[SplitUnit, ...]:
    """The module's split units in structural execution order: accelerate's traversal (own parameters,
    children, own buffers), with a U-Net's middle block moved before its decoder path (`execution_children`).

    A split fills devices in this order, so the closer it is to the order the units run in, the fewer times a
    forward crosses devices. `placement.unit_order.order_units` replaces it by a traced order when the caller
    has example inputs."""
    units: list[SplitUnit] = []
    protected = set(no_split)

    def visit(path: str, mod: nn.Module) -> None:
        children = execution_children(mod)
        if not children or type(mod).__name__ in protected:
            units.append(SplitUnit(path=path, bytes=module_sizes.get(path, 0)))
            return
        for name, _ in mod.named_parameters(recurse=False):
            units.append(SplitUnit(path=_join(path, name), bytes=module_sizes.get(_join(path, name), 0)))
        for name, child in children:
            visit(_join(path, name), child)
        for name, _ in mod.named_buffers(recurse=False):
            units.append(SplitUnit(path=_join(path, name), bytes=module_sizes.get(_join(path, name), 0)))

    visit("", module)
    return tuple(units)


# U-Nets (diffusers' UNet2DConditionModel, its VAE decoder) register the middle block after the up path
# (conv_in, down_blocks, up_blocks, mid_block, ...) but run it between down and up: cut in registration order,
# a UNet split over two GPUs crosses devices 5 times per step instead of once.
_MIDDLE_NAMES = ("mid_block", "mid", "middle_block", "bottleneck")
_UP_PREFIXES = ("up", "output_blocks", "decoder_blocks")


def execution_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`module`'s children in the order a forward is expected to run them, without tracing: registration
    order, except that a middle block registered after the up path is moved just before it."""
    children = list(module.named_children())
    names = [name for name, _ in children]
    middle = next((idx for idx, name in enumerate(names) if name in _MIDDLE_NAMES), None)
    up = next((idx for idx, name in enumerate(names) if name.startswith(_UP_PREFIXES)), None)
    if middle is None or up is None or middle < up:
        return children
    children.insert(up, children.pop(middle))
    return children


def dtype_for(dtype_spec, component: str) -> torch.dtype | None:
    """The dtype `component` loads in: `dtype_spec` is a dtype, None, or `{"name": dtype, "default": dtype}`."""
    if isinstance(dtype_spec, Mapping):
        for key in dtype_spec:
            _resolve_dtype(dtype_spec[key], where=f"torch_dtype[{key!r}]")
        chosen = dtype_spec.get(component, dtype_spec.get("default"))
        return _resolve_dtype(chosen, where=f"torch_dtype[{component!r}]")
    return _resolve_dtype(dtype_spec, where="torch_dtype")


def _resolve_dtype(spec, *, where: str) -> torch.dtype | None:
    """None, a floating torch.dtype, or its name ("bfloat16", "torch.float16") -> the dtype."""
    if spec is None:
        return None
    dtype = spec
    if isinstance(spec, str):
        dtype = getattr(torch, spec.strip().removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise PlanError(
        f"Invalid {where} = {spec!r}: expected a floating torch.dtype such as torch.bfloat16 (or its name, "
        "'bfloat16'), None to keep each tensor's own dtype, or a dict {component: dtype, 'default': dtype}."
    )


def kept_fp32_module_names(module: nn.Module, dtype: torch.dtype | None) -> set[str]:
    """Names of the submodules that loading at `dtype` keeps in float32 (the rule of the module's library)."""
    if dtype is None or dtype == torch.float32 or dtype.itemsize > 4:
        return set()
    is_transformers = hasattr(type(module), "_keep_in_fp32_modules_strict")
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    if is_transformers:
        keep = keep if dtype == torch.float16 else set()
        if dtype in (torch.float16, torch.bfloat16):
            keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    return keep


def dtype_label(module: nn.Module, dtype: torch.dtype | None, *, origin: str | None = None) -> str:
    """The dtype a plan states it assumed for a component: "bfloat16 (requested; float32 kept: wo)" when a dtype
    is requested, else the tensors' own by bytes, e.g. "float32 (as built)". `origin` says where the dtype came
    from ("torch_dtype", "checkpoint", "config.json only: no weights read", ...). A component holding quantized
    tensors says its format instead: "nf4 (bitsandbytes), compute bfloat16 (checkpoint)"."""
    quantized = quantization_label([tensor for _, tensor in named_module_tensors(module, recurse=True)])
    if quantized is not None:
        return f"{quantized} ({origin or 'as built'})"
    if dtype is not None:
        kept = sorted(kept_fp32_module_names(module, dtype) & _tensor_name_parts(module))
        detail = origin or "requested"
        if kept:
            detail += f"; float32 kept: {', '.join(kept)}"
        return f"{_dtype_name(dtype)} ({detail})"
    return f"{tensor_dtypes(module)} ({origin or 'as built'})"


def tensor_dtypes(module: nn.Module) -> str:
    """The floating dtypes of a module's tensors, most bytes first: "bfloat16", "bfloat16+float32"."""
    by_dtype: dict[torch.dtype, int] = {}
    for _, tensor in named_module_tensors(module, recurse=True):
        if tensor.is_floating_point():
            by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    ordered = sorted(by_dtype, key=lambda d: (-by_dtype[d], str(d)))
    return "+".join(_dtype_name(d) for d in ordered) or "no floating tensors"


def _tensor_name_parts(module: nn.Module) -> set[str]:
    return {part for name, _ in named_module_tensors(module, recurse=True) for part in name.split(".")}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _corrections(module: nn.Module, dtype: torch.dtype | None, kept_fp32: Mapping[str, torch.dtype]):
    """(tensor path, bytes to add) wherever accelerate's per-tensor size differs from the loaded size."""
    for name, tensor in named_module_tensors(module, recurse=True):
        if name in kept_fp32:
            continue  # accelerate uses the special dtype exactly, as loading does
        if is_quantized_tensor(tensor):  # stored as quantized, never cast: its real bytes
            yield name, storage_bytes(tensor) - tensor.numel() * _accelerate_itemsize(tensor.dtype, dtype)
            continue
        loaded = tensor.numel() * _loaded_itemsize(tensor.dtype, dtype)
        counted = tensor.numel() * _accelerate_itemsize(tensor.dtype, dtype)
        if loaded != counted:
            yield name, loaded - counted


def _loaded_itemsize(own: torch.dtype, requested: torch.dtype | None) -> int:
    """Bytes per element once loaded: floating tensors take the requested dtype; others keep theirs."""
    if requested is not None and own.is_floating_point:
        return requested.itemsize
    return own.itemsize


def _accelerate_itemsize(own: torch.dtype, requested: torch.dtype | None) -> float:
    """What `compute_module_sizes` counts per element (mirrors its code, including bool = 1/8)."""
    if requested is None or str(own).startswith(("torch.uint", "torch.int", "torch.bool")):
        return _byte_size(own)
    return min(_byte_size(requested), _byte_size(own))


@functools.cache
def _byte_size(dtype: torch.dtype) -> float:
    return dtype_byte_size(dtype)  # cached: accelerate re-checks the torch version on every call


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
