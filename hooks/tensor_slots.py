"""Where a module keeps each of its tensors, so a technique can swap them: `param.data = other` cannot cross to or
from `meta`, so (as accelerate's `set_module_tensor_to_device`) the owning module's `_parameters` / `_buffers`
entry is replaced; a tied weight is one `ModelTensor` with several slots.

`StandIns`: while a placed module is edited, its disk placeholders (`meta`) become CPU tensors of one shared
zero (no memory), so new tensors that peft creates beside them land in host RAM instead of silently on meta (NaN
images later); a write into a stand-in is refused by torch, and `put_back` reports replaced ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from placement.sizing import storage_bytes


@dataclass(frozen=True, kw_only=True, eq=False)
class TensorSlot:
    module: nn.Module
    name: str
    is_parameter: bool

    @property
    def holder(self) -> dict:
        return self.module._parameters if self.is_parameter else self.module._buffers

    def get(self) -> torch.Tensor:
        return self.holder[self.name]


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelTensor:
    """One distinct tensor of a model: `key` is its first qualified name (e.g. "blocks.0.proj.weight")."""

    key: str
    slots: tuple[TensorSlot, ...]

    def get(self) -> torch.Tensor:
        return self.slots[0].get()

    @property
    def num_bytes(self) -> int:
        return storage_bytes(self.get())

    def set(self, value: torch.Tensor) -> None:
        """Put `value` in every slot; parameters keep their `requires_grad` and stay one shared object."""
        current = self.get()
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        for slot in self.slots:
            slot.holder[slot.name] = value


def collect_entries(root: nn.Module) -> dict[int, ModelTensor]:
    slots_by_tensor: dict[int, list[TensorSlot]] = {}
    first_name: dict[int, str] = {}
    for module_name, module in root.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for slot, tensor in direct_slots(module):
            slots_by_tensor.setdefault(id(tensor), []).append(slot)
            first_name.setdefault(id(tensor), prefix + slot.name)
    return {
        tensor_id: ModelTensor(key=first_name[tensor_id], slots=tuple(slots))
        for tensor_id, slots in slots_by_tensor.items()
    }


def direct_tensor_ids(module: nn.Module) -> list[int]:
    return [id(tensor) for _, tensor in direct_slots(module)]


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def direct_slots(module: nn.Module) -> Iterable[tuple[TensorSlot, torch.Tensor]]:
    for name, param in module._parameters.items():
        if param is not None:
            yield TensorSlot(module=module, name=name, is_parameter=True), param
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield TensorSlot(module=module, name=name, is_parameter=False), buffer


@dataclass(frozen=True, kw_only=True, eq=False)
class _Swap:
    name: str
    slots: tuple[TensorSlot, ...]
    placeholder: torch.Tensor
    stand_in: torch.Tensor
    data_ptr: int


class StandIns:
    def __init__(self) -> None:
        self._swaps: list[_Swap] = []

    def put(self, name: str, slots: Sequence[TensorSlot]) -> None:
        """Replace the meta placeholder held in `slots` (one tensor; `name`: its qualified name) by a stand-in."""
        placeholder = slots[0].get()
        value = torch.zeros((), dtype=placeholder.dtype).expand(placeholder.shape)
        stand_in = nn.Parameter(value, requires_grad=placeholder.requires_grad) if slots[0].is_parameter else value
        for slot in slots:
            slot.holder[slot.name] = stand_in
        self._swaps.append(_Swap(name=name, slots=tuple(slots), placeholder=placeholder, stand_in=stand_in,
                                 data_ptr=stand_in.data_ptr()))

    def put_back(self, root: nn.Module) -> list[str]:
        """Put every placeholder back; the problems: weights the edit re-pointed, or whose layer it replaced by
        another holding a weight of that name (a copy of the stand-in computes with zeros)."""
        live = {id(module) for module in root.modules()}
        current = dict(root.named_parameters(remove_duplicate=False))
        current.update(root.named_buffers(remove_duplicate=False))
        changed = []
        for swap in self._swaps:
            replaced = any(id(slot.module) not in live for slot in swap.slots) and swap.name in current
            if replaced or any(id(slot.module) in live and not _holds(slot, swap) for slot in swap.slots):
                changed.append(f"{swap.name} (its weights are on disk; the edit tried to change them)")
            for slot in swap.slots:
                slot.holder[slot.name] = swap.placeholder
        self._swaps = []
        return changed


def _holds(slot: TensorSlot, swap: _Swap) -> bool:
    held = slot.holder.get(slot.name)
    return held is swap.stand_in and held.data_ptr() == swap.data_ptr


__all__ = ["ModelTensor", "StandIns", "TensorSlot", "collect_entries", "direct_slots", "direct_tensor_ids",
           "named_tensors"]
