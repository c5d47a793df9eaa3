"""Stand-ins for weights whose home is the disk, while a placed module is edited (adapters loaded, fused, ...).

Between calls a module placed on disk holds `meta` placeholders: the weights are read from the checkpoint's
files (or a group's offload file) when a layer runs. Code that edits a module decides where new tensors go by
the device of the weight beside them (peft creates a LoRA's matrices on the device of its base layer's weight):
next to a placeholder that is `meta`, where the values are dropped without an error, and the layer then
computes with garbage (NaN images). While an edit runs, each placeholder is replaced by a stand-in: a CPU
tensor of the same shape and dtype whose elements all share one zero (no memory), so new tensors land in host
RAM, beside the weights that are served from there. Writing into a stand-in is impossible (torch refuses to
write into a tensor whose elements share memory) and replacing its data is noticed: `put_back` reports the
weights an edit tried to change, which the disk copy cannot take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .tensor_slots import TensorSlot


@dataclass(frozen=True, kw_only=True, eq=False)
class _Swap:
    name: str
    slots: tuple[TensorSlot, ...]
    placeholder: torch.Tensor
    stand_in: torch.Tensor
    data_ptr: int


class StandIns:
    """The stand-ins put into a module for one edit; `put_back()` restores the placeholders."""

    def __init__(self) -> None:
        self._swaps: list[_Swap] = []

    def __len__(self) -> int:
        return len(self._swaps)

    def put(self, name: str, slots: Sequence[TensorSlot]) -> None:
        """Replace the meta placeholder held in `slots` (one tensor, tied slots included; `name`: its qualified
        name in the edited module now) by a stand-in."""
        placeholder = slots[0].get()
        value = torch.zeros((), dtype=placeholder.dtype).expand(placeholder.shape)
        stand_in = nn.Parameter(value, requires_grad=placeholder.requires_grad) if slots[0].is_parameter else value
        for slot in slots:
            _store(slot)[slot.name] = stand_in
        self._swaps.append(_Swap(name=name, slots=tuple(slots), placeholder=placeholder, stand_in=stand_in,
                                 data_ptr=stand_in.data_ptr()))

    def put_back(self, root: nn.Module) -> list[str]:
        """Put every placeholder back; returns the names (in `root`, as given to `put`) of the weights the
        edit re-pointed, or whose layer it replaced by another holding a weight of that name (a copy made from
        the stand-in computes with its zeros). A weight removed with its layer (an adapter unloaded) is not a
        change."""
        live = {id(module) for module in root.modules()}
        current = dict(root.named_parameters(remove_duplicate=False))
        current.update(root.named_buffers(remove_duplicate=False))
        changed = []
        for swap in self._swaps:
            replaced = any(id(slot.module) not in live for slot in swap.slots) and swap.name in current
            if replaced or any(id(slot.module) in live and not _holds(slot, swap) for slot in swap.slots):
                changed.append(swap.name)
            for slot in swap.slots:
                _store(slot)[slot.name] = swap.placeholder
        self._swaps = []
        return changed


def _holds(slot: TensorSlot, swap: _Swap) -> bool:
    held = _store(slot).get(slot.name)
    return held is swap.stand_in and held.data_ptr() == swap.data_ptr


def _store(slot: TensorSlot) -> dict:
    return slot.module._parameters if slot.is_parameter else slot.module._buffers


__all__ = ["StandIns"]
