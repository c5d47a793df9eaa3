"""What the loader does before dispatch, for tests that dispatch a module built on the CPU: every entry of a
device map that names an accelerator gets its weights on that accelerator (`dispatch` moves inputs, never
weights). Under strict virtual accelerators a test that skips this fails as it would on GPUs."""

from __future__ import annotations

from collections.abc import Mapping

from accelerate.utils import set_module_tensor_to_device
from torch import nn

from placement.devices import is_accelerator, normalize_device, torch_device


def place_resident_weights(module: nn.Module, device_map: Mapping[str, object]) -> nn.Module:
    for path, device in sorted(device_map.items(), key=lambda item: len(item[0])):
        device = normalize_device(device)
        if not is_accelerator(device):
            continue
        owner, _, name = path.rpartition(".")
        holder = module.get_submodule(owner)
        if name in holder._parameters or name in holder._buffers:  # a loose tensor's own key
            set_module_tensor_to_device(module, path, torch_device(device))
        else:
            module.get_submodule(path).to(torch_device(device))
    return module
