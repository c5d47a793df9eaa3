"""Bytes of quantized tensors as they sit in memory, and the words a plan uses for their format.

A quantized weight is not what its `numel() * element_size()` says:
- torchao (`Int8Tensor`, `Float8Tensor`, affine-quantized tensors) and optimum-quanto (`WeightQBytesTensor`, ...)
  are wrapper tensor subclasses whose dtype is the *logical* (compute) dtype: their storage is their inner
  tensors (`__tensor_flatten__`: int8 data, scales, zero points), about half of bf16 for int8;
- a bitsandbytes 4-bit weight (`Params4bit`) is packed uint8 data plus a `quant_state` (absmax per block, its own
  quantization when double-quantized, the code book); an 8-bit one (`Int8Params`) is int8 data plus one float32
  scale per row (`SCB`). On `meta`, before the weights are read, a quantizer's replaced layer holds a dense
  weight that will be quantized at load: its bytes follow from bitsandbytes' block layout (`quantize_4bit`);
- a GGUF weight (diffusers' `GGUFParameter`) is uint8 data of the quantized blocks: counted as it is.

Nothing here imports a quantization package: formats are recognised by their classes' modules and attributes,
so planning works where the package is not installed (a plan made for a machine that has it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

_FLOAT32 = 4
_BNB_NESTED_BLOCKSIZE = 256  # bitsandbytes quantizes a 4-bit weight's absmax in blocks of 256 (double quant)
_BNB_CODE_ENTRIES = {4: 16, 8: 256}  # code book entries: nf4/fp4 (16), the dynamic map of double quant (256)


@dataclass(frozen=True, kw_only=True)
class TensorFormat:
    """How one tensor is stored: `name` ("nf4", "int8", "float8_e4m3fn", "Q4_K") and its `library`."""

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
    """A tensor stored in a quantized format this module knows (its bytes are not numel x element size)."""
    return _library(tensor) is not None or _is_wrapper_subclass(tensor)


def _is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(type(tensor), "__tensor_flatten__")


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` occupies once loaded (on meta: once its weights are read and quantized)."""
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
    """The quantized format of `tensor`, None for a plain tensor."""
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
    """The dtype of the largest inner tensor of a wrapper subclass: int8, float8_e4m3fn, uint8 (packed int4)..."""
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names if isinstance(getattr(tensor, name, None), torch.Tensor)]
    if not inner:
        return str(tensor.dtype).removeprefix("torch.")
    largest = max(inner, key=lambda t: t.numel() * t.element_size())
    return str(largest.dtype).removeprefix("torch.")


def quantization_label(tensors: list[torch.Tensor]) -> str | None:
    """"nf4 (bitsandbytes), compute bfloat16" for a module whose tensors include quantized ones (most bytes first
    when it mixes formats); None when none is quantized. The compute dtype is that of the other floating tensors
    (biases, norms: the dtype the quantized layers compute in)."""
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
    compute = str(max(plain, key=plain.get)).removeprefix("torch.")
    return f"{formats}, compute {compute}"


__all__ = ["TensorFormat", "bnb_4bit_bytes", "is_quantized_tensor", "quantization_label", "storage_bytes",
           "tensor_format"]
