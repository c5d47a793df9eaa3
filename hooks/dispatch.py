"""Apply a relative device map to a loaded module with accelerate hooks, and take the hooks off again.

`dispatch` is `accelerate.dispatch_model(force_hooks=True)` with our device spelling and three fixes:
- modules mapped to "cpu" or "disk" execute on the execution device (an accelerator when there is one),
  their weights streamed in per forward;
- "disk" weights are served from the checkpoint's own safetensors files through an offload index
  (`{name: {"safetensors_file", "weight_name", "dtype"}}`): nothing is copied to an offload folder;
- buffers are never offloaded (`offload_buffers=False`), so the caller loads persistent buffers of disk
  modules to the CPU (the checkpoint loader does) instead of losing them as accelerate's default does.
A dispatch that fails removes every hook it attached before re-raising.
"""

from __future__ import annotations

import warnings
from typing import Mapping

import torch
from accelerate import dispatch_model
from accelerate.hooks import AlignDevicesHook, remove_hook_from_module
from accelerate.utils import OffloadedWeightsLoader, set_module_tensor_to_device
from torch import nn

from placement.devices import Device, is_accelerator, normalize_device, torch_device
from placement.errors import PlacementError
from placement.device_maps import flatten_device_map, owning_key

from .hook_utils import find_hooks

DiskWeights = Mapping[str, Mapping[str, str]]


class DispatchError(PlacementError, ValueError):
    """A device map that cannot be applied: incomplete, disk entries without weights to serve, bad devices."""


def dispatch(
    module: nn.Module,
    device_map: Mapping[str, Device],
    *,
    execution_device: Device | None = None,
    disk_weights: DiskWeights | None = None,
) -> nn.Module:
    """Attach hooks so `module` runs as `device_map` ({submodule path: device}, "" = whole) places it.

    Weights of accelerator and plain-CPU entries must already be on their device (the loader puts them
    there); "cpu" entries are offloaded when an accelerator executes; "disk" parameters are on meta and
    served by `disk_weights`. Nested keys (`{"": "cpu", "blocks.0": "disk"}`) mean "the longest prefix wins";
    they are flattened first, because accelerate hooks a mapped module whole. `execution_device` (default:
    the first accelerator in the map, else "cpu") runs the offloaded parts and receives the inputs. Sets
    `module.hf_device_map` to the flattened map.
    """
    normalized = flatten_device_map(module, {name: normalize_device(device) for name, device in device_map.items()})
    main = _execution_device(normalized, execution_device)
    disk_index = _disk_index(module, normalized, disk_weights)
    normalized = _place_direct_tensors(module, normalized, main, disk_index)
    try:
        with warnings.catch_warnings():
            # accelerate's check_device_map warns about keys naming a tensor (which its own
            # infer_auto_device_map emits); _place_direct_tensors has placed those already.
            warnings.filterwarnings("ignore", message="The following device_map keys do not match any submodules")
            dispatch_model(
                module,
                device_map=normalized,
                main_device=main,
                offload_index=disk_index,
                offload_buffers=False,
                force_hooks=True,
            )
    except BaseException:
        remove_hook_from_module(module, recurse=True)
        raise
    module.hf_device_map = dict(normalized)
    return module


def undispatch(module: nn.Module) -> None:
    """Remove every accelerate hook under `module`; offloaded weights come back as real tensors.

    CPU-offloaded weights return to the CPU (accelerate restores them), disk-offloaded ones are read from
    their files onto the CPU (accelerate would leave them on meta), so the module is whole again and `.to()`
    works. Weights already on accelerators stay where they are.
    """
    for _, submodule, hook in find_hooks(module, AlignDevicesHook):
        _materialize_disk_weights(submodule, hook)
    remove_hook_from_module(module, recurse=True)
    if getattr(module, "hf_device_map", None) is not None:
        module.hf_device_map = None


def _execution_device(device_map: Mapping[str, Device], requested: Device | None) -> Device:
    if requested is not None:
        device = normalize_device(requested)
        if device == "disk":
            raise DispatchError("execution_device cannot be 'disk': pick an accelerator index or 'cpu'.")
        return device
    accelerators = sorted(d for d in set(device_map.values()) if is_accelerator(d))
    return accelerators[0] if accelerators else "cpu"


def _place_direct_tensors(
    module: nn.Module, device_map: Mapping[str, Device], main: Device, disk_index: DiskWeights | None
) -> dict[str, Device]:
    """Keys naming a tensor rather than a module (a top-level `pos_embed`, a model's own buffer): accelerate
    hooks modules only, so it would leave such a tensor where it is, on meta when planned for "disk". Each one
    is put where it executes instead: its accelerator, else the execution device (offloading one tensor saves
    too little to be worth a hook). Returns the map with those keys pointing where their tensor now is; a key
    naming neither a module nor a tensor is a DispatchError."""
    modules = dict(module.named_modules())
    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    unknown = [key for key in device_map if key not in modules and key not in tensors]
    if unknown:
        raise DispatchError(
            f"device_map keys {unknown} name neither a submodule nor a tensor of {type(module).__name__}; "
            f"its top-level names are {[name for name, _ in module.named_children()]}. Use paths from "
            "named_modules()."
        )
    placed = dict(device_map)
    served = OffloadedWeightsLoader(index=disk_index) if disk_index else {}
    for key, device in device_map.items():
        if key in modules:
            continue
        target = device if is_accelerator(device) else main
        value = served[key] if tensors[key].device.type == "meta" and key in served else tensors[key]
        if value.device.type == "meta":
            raise DispatchError(f"{key!r} is on meta and no disk_weights entry serves it: load it first.")
        set_module_tensor_to_device(module, key, torch_device(target), value=value, dtype=value.dtype)
        placed[key] = target
    return placed


def _disk_index(module: nn.Module, device_map: Mapping[str, Device], disk_weights: DiskWeights | None):
    disk_prefixes = [name for name, device in device_map.items() if device == "disk"]
    if not disk_prefixes:
        return None
    parameters = [
        name
        for name, _ in module.named_parameters()
        if owning_key(name, disk_prefixes) is not None
    ]
    unserved = [name for name in parameters if disk_weights is None or name not in disk_weights]
    if unserved:
        raise DispatchError(
            f"The device map puts {', '.join(repr(p) for p in disk_prefixes)} on 'disk', but no disk_weights "
            f"entry serves {len(unserved)} of their parameters (e.g. {unserved[0]!r}). Pass the checkpoint's "
            "offload index (WeightsIndex.offload_index) as disk_weights."
        )
    return {name: dict(info) for name, info in disk_weights.items()}


def _materialize_disk_weights(submodule: nn.Module, hook: AlignDevicesHook) -> None:
    if not hook.offload or hook.weights_map is None:
        return
    meta = torch.device("meta")
    for name, original in getattr(hook, "original_devices", {}).items():
        if original != meta:
            continue  # accelerate's detach_hook restores weights that had a real device
        try:
            value = hook.weights_map[name].to("cpu")
        except KeyError:
            continue  # not served by the hook (e.g. a buffer): left as it is
        set_module_tensor_to_device(submodule, name, "cpu", value=value, dtype=value.dtype)


__all__ = ["DispatchError", "dispatch", "undispatch"]
