"""Bytes of a module at a requested dtype, and the units a device map may place independently.

Sizes are `accelerate.utils.compute_module_sizes`, corrected where it is wrong for loading: bools take a byte,
a smaller floating tensor is cast up, non-floating tensors are never cast, `_keep_in_fp32_modules` skips
non-floating ones. Quantized tensors (torchao, quanto, bitsandbytes, GGUF) count their real storage; formats are
recognised by class module and attributes, so no quantization package need be installed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from accelerate.utils import compute_module_sizes
from accelerate.utils.modeling import dtype_byte_size, named_module_tensors
from torch import nn

from .errors import PlanError


@dataclass(frozen=True, kw_only=True)
class SplitUnit:
    """A `_no_split_modules` block, a leaf outside them, or a tensor held by a module with children."""

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
    names = getattr(module, "_no_split_modules", None) or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(dict.fromkeys(str(name) for name in names))


def block_classes(module: nn.Module) -> tuple[str, ...]:
    """Classes of the ModuleList/Sequential members: kept whole when no `_no_split_modules` is declared, since a
    block's forward mixes its own tensors with its submodules' outputs (FLUX's `gate_mlp * ff(x)`)."""
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
    """`{tensor path: torch.float32}` for the floating tensors loading keeps in float32 (`kept_fp32_module_names`;
    a name matches one dotted part of the path, "wo" in "block.0.wo.weight")."""
    keep = kept_fp32_module_names(module, dtype)
    if not keep:
        return {}
    return {
        name: torch.float32
        for name, tensor in named_module_tensors(module, recurse=True)
        if tensor.is_floating_point() and not is_quantized_tensor(tensor) and not keep.isdisjoint(name.split("."))
    }


def split_units(module: nn.Module, module_sizes: Mapping[str, int], no_split: tuple[str, ...]) -> tuple[SplitUnit, ...]:
    """Split units in the order a split fills devices: accelerate's traversal, `execution_children` order (a
    traced order replaces it when the caller has inputs: `unit_order.order_units`)."""
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


# U-Nets register the middle block after the up path but run it between down and up: cut in registration order,
# a UNet split over two GPUs crosses devices 5 times per step instead of once.
_MIDDLE_NAMES = ("mid_block", "mid", "middle_block", "bottleneck")
_UP_PREFIXES = ("up", "output_blocks", "decoder_blocks")


def execution_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Registration order, with a middle block registered after the up path moved just before it."""
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
    """Submodule names loading at `dtype` keeps in float32: diffusers' `_keep_in_fp32_modules` always,
    transformers' only in fp16, plus `_keep_in_fp32_modules_strict` in fp16 and bf16."""
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
    """The dtype a plan states: "bfloat16 (requested; float32 kept: wo)", "float32 (as built)", or a quantized
    format, "nf4 (bitsandbytes), compute bfloat16 (checkpoint)"; `origin` replaces "requested"/"as built"."""
    tensors = list(named_module_tensors(module, recurse=True))  # one walk of the module for both questions
    quantized = quantization_label([tensor for _, tensor in tensors])
    if quantized is not None:
        return f"{quantized} ({origin or 'as built'})"
    if dtype is not None:
        parts = {part for name, _ in tensors for part in name.split(".")}
        kept = sorted(kept_fp32_module_names(module, dtype) & parts)
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _corrections(module: nn.Module, dtype: torch.dtype | None, kept_fp32: Mapping[str, torch.dtype]):
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


_FLOAT32 = 4
_BNB_NESTED_BLOCKSIZE = 256  # bitsandbytes quantizes a 4-bit weight's absmax in blocks of 256 (double quant)
_BNB_CODE_ENTRIES = {4: 16, 8: 256}  # code book entries: nf4/fp4 (16), the dynamic map of double quant (256)


@dataclass(frozen=True, kw_only=True)
class TensorFormat:
    """How one tensor is stored: "nf4", "int8", "float8_e4m3fn", "Q4_K", and its library."""

    name: str
    library: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.library})"


def _library(tensor: torch.Tensor) -> str | None:
    module = type(tensor).__module__
    for prefix, library in (("bitsandbytes", "bitsandbytes"), ("torchao", "torchao"), ("optimum.quanto", "quanto"),
                            ("diffusers.quantizers.gguf", "gguf"), ("transformers.integrations.ggml", "gguf")):
        if module.startswith(prefix):
            return library
    return None


def is_quantized_tensor(tensor: torch.Tensor) -> bool:
    return _library(tensor) is not None or _is_wrapper_subclass(tensor)


def _is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(type(tensor), "__tensor_flatten__")


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` occupies once loaded (on meta: once quantized). torchao/quanto wrapper subclasses: their
    inner tensors; bitsandbytes: packed data plus its quant state (or, on meta, its block layout)."""
    library = _library(tensor)
    if library == "bitsandbytes":
        return _bnb_bytes(tensor)
    if _is_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(storage_bytes(inner) for inner in (getattr(tensor, name) for name in names) if inner is not None)
    return tensor.numel() * tensor.element_size()


def _bnb_bytes(tensor: torch.Tensor) -> int:
    if type(tensor).__name__ == "Int8Params":
        rows = tensor.shape[0] if tensor.dim() else 1
        return tensor.numel() + rows * _FLOAT32  # int8 data (quantized at load if not yet), a float32 scale per row
    state = getattr(tensor, "quant_state", None)
    if state is not None:  # quantized: its packed data and every tensor of its quant state
        return tensor.numel() * tensor.element_size() + sum(t.numel() * t.element_size() for t in _state_tensors(state))
    return bnb_4bit_bytes(tensor.numel(), blocksize=getattr(tensor, "blocksize", 64),
                          double_quant=bool(getattr(tensor, "compress_statistics", True)))


def bnb_4bit_bytes(numel: int, *, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes of a weight of `numel` elements once bitsandbytes quantizes it to 4 bits (nf4 or fp4): packed data,
    absmax per block (float32, or uint8 with its own absmax and code book when double-quantized), code book."""
    blocks = math.ceil(numel / blocksize)
    data = (numel + 1) // 2
    if not double_quant:
        absmax = blocks * _FLOAT32
    else:
        nested_blocks = math.ceil(blocks / _BNB_NESTED_BLOCKSIZE)
        absmax = blocks + nested_blocks * _FLOAT32 + _BNB_CODE_ENTRIES[8] * _FLOAT32 + _FLOAT32  # + offset
    return data + absmax + _BNB_CODE_ENTRIES[4] * _FLOAT32


def _state_tensors(state) -> Iterator[torch.Tensor]:
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            yield value
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _state_tensors(nested)


def tensor_format(tensor: torch.Tensor) -> TensorFormat | None:
    library = _library(tensor)
    if library is None and not _is_wrapper_subclass(tensor):
        return None
    if library == "bitsandbytes":
        name = "int8" if type(tensor).__name__ == "Int8Params" else str(getattr(tensor, "quant_type", "4bit"))
    elif library == "gguf":
        kind = getattr(tensor, "quant_type", None)
        name = getattr(kind, "name", str(kind))
    else:
        name = _inner_dtype_name(tensor)
    return TensorFormat(name=name, library=library or type(tensor).__name__)


def _inner_dtype_name(tensor: torch.Tensor) -> str:
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names if isinstance(getattr(tensor, name, None), torch.Tensor)]
    if not inner:
        return _dtype_name(tensor.dtype)
    return _dtype_name(max(inner, key=lambda t: t.numel() * t.element_size()).dtype)


def quantization_label(tensors: list[torch.Tensor]) -> str | None:
    """"nf4 (bitsandbytes), compute bfloat16" (formats by bytes; compute: the plain floating tensors' dtype), or
    None when nothing is quantized."""
    by_format: dict[str, int] = {}
    plain: dict[torch.dtype, int] = {}
    for tensor in tensors:
        found = tensor_format(tensor)
        if found is not None:
            by_format[found.label] = by_format.get(found.label, 0) + storage_bytes(tensor)
        elif tensor.is_floating_point():
            plain[tensor.dtype] = plain.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    if not by_format:
        return None
    formats = "+".join(sorted(by_format, key=lambda label: -by_format[label]))
    if not plain:
        return formats
    return f"{formats}, compute {_dtype_name(max(plain, key=plain.get))}"
