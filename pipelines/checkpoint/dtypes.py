"""Which checkpoint dtypes a model takes as they are, checked from the headers before anything loads.

A float checkpoint tensor is cast when `torch_dtype` asks for it. Without `torch_dtype` each tensor keeps the
checkpoint's dtype, so one parameter stored in another float dtype than the rest would load as is and fail at the
first call (a float16 weight meeting float32 activations): that is refused here, naming the tensor. Integer and
bool tensors (token ids, counters, masks) are never cast, so they must match the model's dtype exactly.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

import torch
from torch import nn

from ..errors import FolderError
from .checkpoint_errors import list_names
from .index import TensorEntry, WeightsIndex


def check_dtypes(module: nn.Module, weights: WeightsIndex, *, dtype: torch.dtype | None,
                 keep_in_fp32: Iterable[str] = (), model_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise `FolderError` for tensors of `weights` the model `module` (on meta) cannot take.
    `model_tensors`: `module.state_dict(keep_vars=True)` when the caller has it already."""
    model = dict(module.state_dict(keep_vars=True)) if model_tensors is None else model_tensors
    matched = {name: entry for name, entry in weights.tensors.items() if name in model}
    kinds = [f"{name!r}: checkpoint {_short(entry.dtype)}, model {_short(model[name].dtype)}"
             for name, entry in sorted(matched.items()) if _kind_differs(entry.dtype, model[name].dtype)]
    if kinds:
        raise FolderError(
            f"Checkpoint {str(weights.folder)!r} holds tensors of another kind than the model's: {'; '.join(kinds)}. "
            "Integer and bool tensors are never cast; re-save the checkpoint with the model's dtypes."
        )
    if dtype is not None:
        return
    keep = tuple(keep_in_fp32)
    parameters = {name for name, tensor in model.items() if isinstance(tensor, nn.Parameter)}
    floats = {name: entry for name, entry in matched.items()
              if name in parameters and entry.dtype.is_floating_point and not _kept(name, keep)}
    _check_one_float_dtype(floats, weights)


def _check_one_float_dtype(floats: dict[str, TensorEntry], weights: WeightsIndex) -> None:
    counts = Counter(entry.dtype for entry in floats.values())
    if len(counts) < 2:
        return
    dominant = counts.most_common(1)[0][0]
    odd = [f"{name} ({_short(entry.dtype)})" for name, entry in floats.items() if entry.dtype != dominant]
    raise FolderError(
        f"Checkpoint {str(weights.folder)!r} mixes float dtypes: {len(floats) - len(odd)} parameter(s) are "
        f"{_short(dominant)} but {len(odd)} are not: {list_names(odd)}. Loaded as is, the model would fail at its "
        f"first call; pass torch_dtype (e.g. torch_dtype=torch.{_short(dominant)}) to cast them all, or re-save it."
    )


def _kind_differs(saved: torch.dtype, model: torch.dtype) -> bool:
    if saved.is_floating_point and model.is_floating_point:
        return False  # a cast or the checkpoint's own dtype: decided by torch_dtype
    return saved != model


def _kept(name: str, keep_in_fp32: tuple[str, ...]) -> bool:
    return bool(keep_in_fp32) and any(part in keep_in_fp32 for part in name.split("."))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
