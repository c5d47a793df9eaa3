"""Editing a module run by a device map (`dispatch`): whole, split, cpu, disk, and offloaded with part resident.

Resident entries hold their weights on their device; an edit there (peft adds a LoRA beside its base layer,
on the base weight's device) needs nothing but a check that new tensors sit on their entry's device. Streamed
entries ("disk", or "cpu" while an accelerator executes) hold `meta` between forwards, each layer's weights
served by its `ServeWeightsHook` from host RAM (a CPU state dict) or the checkpoint's files. For an edit:
- open: each served weight homed in RAM is put back into its module (the stored tensor itself: a fuse writes
  into it), each one homed on disk gets a stand-in (`stand_ins`), so new tensors are created in host RAM;
- close: weights the edit replaced go back into the hook's RAM store; every served slot is `meta` again;
  modules holding new tensors in a streamed entry get a hook serving them from host RAM like their
  neighbours (a container that never runs, e.g. a ParameterDict, has its tensors moved to the executing
  device instead); tensors of resident entries are moved to their entry's device if they are elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, set_module_tensor_to_device
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from placement.devices import Device, torch_device

from .dispatch import ServeWeightsHook, serve_from_host
from .edit_support import is_streamed, mapped_homes, settle
from .hook_utils import find_hooks, hooks_of, runs_forward
from .input_moving import MoveInputsHook
from .stand_ins import StandIns
from .tensor_slots import TensorSlot


class DeviceMapEdit:
    """One edit of a dispatched module (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        device_map = getattr(module, "hf_device_map", None)
        self.device_map = dict(device_map) if isinstance(device_map, dict) else {"": "cpu"}
        self.main = execution_place_of(module)
        self.stand_ins = StandIns()
        # (slot, (the hook's store, key there), the tensor put in, the data pointer of its home)
        self._homed: list[tuple[TensorSlot, Any, torch.Tensor, int]] = []

    def open(self) -> None:
        for path, submodule, hook in find_hooks(self.module, ServeWeightsHook):
            for name, _ in named_module_tensors(submodule, include_buffers=hook.offload_buffers,
                                                recurse=hook.place_submodules, remove_non_persistent=True):
                slot = TensorSlot(module=submodule, name=name, is_parameter=name in submodule._parameters)
                store, key = _store_of(hook.weights_map, name)
                home = store.get(key) if store is not None else None
                if home is None:
                    self.stand_ins.put(f"{path}.{name}" if path else name, [slot])
                    continue
                placeholder = slot.get()
                value = nn.Parameter(home, requires_grad=placeholder.requires_grad) if slot.is_parameter else home
                _slots(slot)[name] = value
                self._homed.append((slot, (store, key), value, home.data_ptr()))

    def close(self) -> list[str]:
        problems = [f"{name} (its weights are on disk; the edit tried to change them)"
                    for name in self.stand_ins.put_back(self.module)]
        for slot, (store, key), put, home_pointer in self._homed:
            held = slot.get()
            if held is not put or held.data_ptr() != home_pointer:
                store[key] = held.detach().to("cpu")  # replaced (e.g. `weight.data = merged`): store the new one
            placeholder = torch.empty_like(held, device="meta")
            _slots(slot)[slot.name] = nn.Parameter(placeholder, requires_grad=held.requires_grad) \
                if slot.is_parameter else placeholder
        self._homed = []
        return problems + self._serve_new()

    def _serve_new(self) -> list[str]:
        served = {id(tensor) for _, submodule, hook in find_hooks(self.module, ServeWeightsHook)
                  for _, tensor in named_module_tensors(submodule, recurse=hook.place_submodules)}
        streamed, no_data = settle(self.module, self.device_map, self.main, served)
        for path, submodule in streamed:
            if any(tensor.is_meta for tensor in submodule.parameters(recurse=False)):
                continue  # reported in no_data: nothing holds its values
            if runs_forward(submodule):
                serve_from_host(submodule, self.main)
            else:
                for name, _ in named_module_tensors(submodule, include_buffers=True, recurse=False):
                    set_module_tensor_to_device(submodule, name, torch_device(self.main))
        return [f"{name} (no data: created on meta, nothing serves it)" for name in no_data]

    def homes(self) -> dict[str, Device]:
        """Where each weight lives between calls: its entry's device, "cpu" (served from RAM) or "disk"."""
        found: dict[str, Device] = {}
        mapped = mapped_homes(self.module, self.device_map)
        for path, submodule in self.module.named_modules():
            prefix = f"{path}." if path else ""
            hooks = [hook for hook in hooks_of(submodule) if isinstance(hook, ServeWeightsHook)]
            for name, tensor in named_module_tensors(submodule, recurse=False):
                if hooks:
                    store, key = _store_of(hooks[0].weights_map, name)
                    found[prefix + name] = "cpu" if store is not None and key in store else "disk"
                else:  # in a streamed entry without a hook: kept where it runs (see _serve_new)
                    home = mapped.get(id(tensor), "cpu")
                    found[prefix + name] = self.main if is_streamed(home, self.main) else home
        return found


def execution_place_of(module: nn.Module) -> Device:
    """Where a dispatched module executes: the place of the input-moving hook at its top."""
    for hook in hooks_of(module):
        if isinstance(hook, MoveInputsHook):
            return hook.place
    return "cpu"


def _store_of(weights_map, name: str):
    """(the in-memory mapping that holds `name`'s served value, its key there); (None, None) when the value is
    read from a file (a checkpoint's, through the hook's offload index)."""
    key = name
    if isinstance(weights_map, PrefixedDataset):
        weights_map, key = weights_map.dataset, weights_map.prefix + name
    if isinstance(weights_map, OffloadedWeightsLoader):
        return (weights_map.state_dict, key) if key in weights_map.state_dict else (None, None)
    return (weights_map, key) if isinstance(weights_map, dict) else (None, None)


def _slots(slot: TensorSlot) -> dict:
    return slot.module._parameters if slot.is_parameter else slot.module._buffers


__all__ = ["DeviceMapEdit", "execution_place_of"]
