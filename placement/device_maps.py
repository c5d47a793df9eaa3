"""Device maps `{module or tensor path: device}`, read by planning, the loader and the runtime through this module.

Paths are relative to the module a map places; "" is the module itself. A key owns every tensor under it,
and the longest key wins (`{"": "cpu", "blocks.0": 0}` puts block 0 on accelerator 0, the rest on the CPU).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn

from .devices import Device, check_can_execute, normalize_device
from .errors import InvalidDeviceError, PlanError


def owning_key(path: str, keys: Collection[str]) -> str | None:
    """The longest of `keys` that contains `path` (itself or a module prefix of it; "" contains everything),
    or None: the key of a device map that places `path`."""
    return next((prefix for prefix in reversed(prefixes(path)) if prefix in keys), None)


def prefixes(path: str) -> list[str]:
    """"a.b.c" -> ["", "a", "a.b", "a.b.c"]: every module path that contains `path`, outermost first."""
    if not path:
        return [""]
    parts = path.split(".")
    return [".".join(parts[:idx]) for idx in range(len(parts) + 1)]


def merge_to_prefixes(unit_devices: Mapping[str, Device]) -> dict[str, Device]:
    """Collapse `{unit path: device}` to the coarsest module prefixes that sit on one device (like
    accelerate's `clean_device_map`); everything on one device becomes `{"": device}`."""
    devices_under: dict[str, set] = {}
    for path, device in unit_devices.items():
        for prefix in prefixes(path):
            devices_under.setdefault(prefix, set()).add(device)
    merged: dict[str, Device] = {}
    for path, device in unit_devices.items():
        for prefix in prefixes(path):
            if len(devices_under[prefix]) == 1:
                merged.setdefault(prefix, device)
                break
    return merged


def flatten_device_map(module: nn.Module, device_map: Mapping[str, Device]) -> dict[str, Device]:
    """The same placement without nested keys: a key with mapped descendants is replaced by its children
    (submodules and direct tensors) that are not mapped themselves, recursively. Disjoint maps are unchanged.
    (accelerate hooks a mapped module whole, so it needs disjoint keys.)"""
    flat = dict(device_map)
    while True:
        parent = next((key for key in flat if _has_mapped_descendant(key, flat)), None)
        if parent is None:
            return flat
        device = flat.pop(parent)
        owner = module.get_submodule(parent)
        prefix = f"{parent}." if parent else ""
        children = [name for name, _ in owner.named_children()]
        children += [name for name, _ in owner.named_parameters(recurse=False)]
        children += [name for name, _ in owner.named_buffers(recurse=False)]
        for child in children:
            flat.setdefault(prefix + child, device)


def _has_mapped_descendant(key: str, device_map: Mapping[str, Device]) -> bool:
    prefix = f"{key}." if key else ""
    return any(other != key and other.startswith(prefix) for other in device_map)


def tensor_devices(module: nn.Module, device_map: Mapping[str, Device] | None) -> dict[str, Device]:
    """The device of every parameter and persistent buffer: its longest matching `device_map` key
    (None: everything on the CPU). A tied tensor (one tensor under several names, e.g. T5's `shared.weight` and
    `encoder.embed_tokens.weight`) is one tensor: listed once, under its first name, placed by the first of its
    names a key covers (sizing counts it once, under that first name, and a map may name either module). A tensor
    no key covers is a PlanError."""
    normalized = {"": "cpu"} if device_map is None else {k: normalize_device(v) for k, v in device_map.items()}
    devices, unmapped = {}, []
    for names in distinct_tensor_names(module):
        owner = next((key for key in (owning_key(name, normalized) for name in names) if key is not None), None)
        if owner is None:
            unmapped.append(names[0])
        else:
            devices[names[0]] = normalized[owner]
    if unmapped:
        raise PlanError(
            f"The device_map does not place {len(unmapped)} tensor(s) of {type(module).__name__}, e.g. "
            f"{unmapped[0]!r}. Map every submodule (or '' for the whole model) to a device."
        )
    return devices


def distinct_tensor_names(module: nn.Module) -> list[list[str]]:
    """The qualified names of each distinct parameter and persistent buffer, in state_dict order: a tied tensor
    gives one list of all its names, the first of which is the one state_dict meets first."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return list(by_tensor.values())


def needs_hooks(device_map: Mapping[str, Device], execution_device: Device | None = None) -> bool:
    """Hooks are needed when weights span devices, live on disk, or sit on one device while another runs
    them (CPU RAM executed by an accelerator)."""
    devices = {normalize_device(device) for device in device_map.values()}
    if len(devices) > 1 or "disk" in devices:
        return True
    return execution_device is not None and normalize_device(execution_device) not in devices


def single_device(spec) -> Device | None:
    """The device a `device_map` names when it is one device ("cuda", "cuda:1", 0, "cpu", a torch.device),
    else None (a strategy name, a dict, anything else). "disk" is refused: it cannot execute."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, torch.device)):
        return None
    try:
        device = normalize_device(spec)
    except InvalidDeviceError:
        return None
    check_can_execute(device, what=f"device_map={spec!r}")
    return device


def is_single_device(device_map) -> bool:
    """A device_map naming one device: everything there, no hooks."""
    try:
        return single_device(device_map) is not None
    except InvalidDeviceError:
        return False


__all__ = ["check_can_execute", "distinct_tensor_names", "flatten_device_map", "is_single_device", "merge_to_prefixes",
           "needs_hooks", "owning_key", "prefixes", "single_device", "tensor_devices"]
