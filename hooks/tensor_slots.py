"""Where a module keeps each of its tensors, so a technique can swap them without caring about identity.

Offloading replaces a module's parameters and buffers with other tensors (a device copy, a CPU copy, a
`meta` placeholder while the weights live on disk). `param.data = other` cannot cross to or from `meta`, so,
as accelerate's `set_module_tensor_to_device` does, we replace the `nn.Parameter` object in the owning
module's `_parameters` (or the buffer in `_buffers`). A tied weight (one tensor held by several modules) is
one `ModelTensor` with several slots, all of which receive the same new tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from placement.sizing import storage_bytes


@dataclass(frozen=True, kw_only=True, eq=False)
class TensorSlot:
    """One attribute (`name`) of one module that holds a parameter or a buffer."""

    module: nn.Module
    name: str
    is_parameter: bool

    def get(self) -> torch.Tensor:
        store = self.module._parameters if self.is_parameter else self.module._buffers
        return store[self.name]


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelTensor:
    """One distinct tensor of a model: `key` is its first qualified name (e.g. "blocks.0.proj.weight")."""

    key: str
    slots: tuple[TensorSlot, ...]

    def get(self) -> torch.Tensor:
        return self.slots[0].get()

    @property
    def num_bytes(self) -> int:
        """Its storage: a quantized tensor's packed data and scales (`placement.sizing`)."""
        return storage_bytes(self.get())

    def set(self, value: torch.Tensor) -> None:
        """Put `value` in every slot; parameters keep their `requires_grad` and stay one shared object."""
        current = self.get()
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        for slot in self.slots:
            store = slot.module._parameters if slot.is_parameter else slot.module._buffers
            store[slot.name] = value


def collect_entries(root: nn.Module) -> dict[int, ModelTensor]:
    """Every distinct tensor under `root`, keyed by `id(tensor)`, in `named_modules()` order."""
    slots_by_tensor: dict[int, list[TensorSlot]] = {}
    first_name: dict[int, str] = {}
    for module_name, module in root.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for slot, tensor in _direct_slots(module):
            slots_by_tensor.setdefault(id(tensor), []).append(slot)
            first_name.setdefault(id(tensor), prefix + slot.name)
    return {
        tensor_id: ModelTensor(key=first_name[tensor_id], slots=tuple(slots))
        for tensor_id, slots in slots_by_tensor.items()
    }


def direct_tensor_ids(module: nn.Module) -> list[int]:
    """ids of the tensors `module` holds itself (not its children's)."""
    return [id(tensor) for _, tensor in _direct_slots(module)]


def _direct_slots(module: nn.Module) -> Iterable[tuple[TensorSlot, torch.Tensor]]:
    for name, param in module._parameters.items():
        if param is not None:
            yield TensorSlot(module=module, name=name, is_parameter=True), param
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield TensorSlot(module=module, name=name, is_parameter=False), buffer
