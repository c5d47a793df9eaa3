"""Model-level device maps: what `ModelMixin.from_pretrained(device_map=...)` turns into `{path: device}`.

Strategies go through accelerate (`get_balanced_memory`, `infer_auto_device_map` with the model's
`no_split_module_classes`), with these corrections:
- sizes are ours (`placement.sizing`: bools, casts, fp32-kept modules) and every answer is checked against
  the real budgets; size strings are parsed by `placement.sizes` (never gigabits);
- accelerators are renamed 0..n-1 before accelerate sees them, so `balanced_low_0` reads budgets by key,
  not by position (accelerate indexes `max_memory[0]`, `range(1, n)`);
- a class without `_no_split_modules` is placed whole (diffusers raises for "auto"; cutting an unknown
  architecture anywhere could separate tensors a `torch.cat` joins);
- when accelerate offloads to the CPU or disk although the weights fit on the accelerators (it keeps room
  for the largest layer on the first GPU), the exact split of `placement.splitting` is taken instead;
- devices fill in the order accelerators, "cpu", then "disk"; "disk" needs an `offload_folder`, unless the
  caller reads disk-offloaded weights straight from the safetensors checkpoint (`disk_ok=True`).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping

import torch
from accelerate.utils import get_balanced_memory
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from .budgets import Budgets, resolve_budgets
from .devices import (  # accelerators_present: re-exported for callers of this module, lives in devices
    HOST_DEVICES,
    Device,
    accelerators_present,
    device_label,
    is_accelerator,
    normalize_device,
)
from .errors import InvalidDeviceError
from .planning_errors import DoesNotFitError, OffloadFolderRequiredError, StrategyError
from .sizes import format_bytes
from .sizing import ComponentSize, SplitUnit, fp32_kept_tensors, size_module
from .splitting import (
    accelerate_device_map,
    assign_units,
    merge_to_prefixes,
    owning_key,
    quiet_accelerate,
    split_device_map,
)

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def model_device_map(
    module: nn.Module,
    device_map,
    *,
    max_memory: Mapping | None = None,
    dtype: torch.dtype | None = None,
    offload_folder=None,
    disk_ok: bool = False,
) -> dict[str, Device] | None:
    """The `{module path: device}` map for loading `module` (usually on meta) with `device_map`.

    `device_map`: None (returns None), a single device ("cpu", "cuda", "cuda:1", 1, a torch.device),
    one of `STRATEGIES`, or a dict `{module or tensor path: device}` (validated). Accelerators are ints.
    """
    if device_map is None:
        return None
    disk_allowed = offload_folder is not None or disk_ok
    if isinstance(device_map, Mapping):
        return _explicit_map(module, device_map, max_memory, dtype, disk_allowed)
    if isinstance(device_map, str) and device_map.strip().lower() in STRATEGIES:
        return _strategy_map(module, device_map.strip().lower(), max_memory, dtype, disk_allowed)
    return _single_device_map(module, device_map, max_memory, dtype)


def _single_device_map(module, spec, max_memory, dtype) -> dict[str, Device]:
    try:
        device = normalize_device(spec)
    except InvalidDeviceError:
        raise StrategyError(
            f"Unknown device_map {spec!r} for {type(module).__name__}: expected one of {', '.join(STRATEGIES)}, "
            "a device ('cpu', 'cuda', 'cuda:1', 0, a torch.device) or a dict {module path: device}."
        ) from None
    if device == "disk":
        raise StrategyError(
            f"device_map='disk' for {type(module).__name__}: the disk holds weights but cannot run them; use "
            "device_map='auto' with an offload_folder to offload part of the model to disk."
        )
    if max_memory is not None:
        limit = resolve_budgets(max_memory).limits.get(device)
        total = size_module(module, dtype).total
        if limit is not None and total > limit:
            raise DoesNotFitError(
                f"{type(module).__name__} needs {format_bytes(total)}{_dtype_note(dtype)} but max_memory gives "
                f"{device_label(device)} {format_bytes(limit)}. Pass a larger max_memory or device_map='auto'."
            )
    return {"": device}


def _strategy_map(module, strategy, max_memory, dtype, disk_allowed) -> dict[str, Device]:
    if max_memory is None and accelerators_present() == 0:
        warnings.warn(
            f"device_map={strategy!r}: no accelerator found, placing {type(module).__name__} on the CPU.",
            stacklevel=3,
        )
        return {"": "cpu"}
    budgets = resolve_budgets(max_memory)
    size = _placeable_size(module, dtype)
    limits = {d: limit for d, limit in budgets.limits.items() if d != "disk" or disk_allowed}
    targets = _targets(module, strategy, budgets, size, dtype)
    assignment = _accelerate_assignment(module, targets, size, dtype)
    valid = assignment is not None and _fits(assignment, size.split_units, limits)
    if valid and not _uses_host(assignment):
        return merge_to_prefixes(assignment)
    for room in _unique(targets, budgets.limits):  # accelerate offloaded: do the weights fit the GPUs alone?
        gpu_room = {d: room[d] for d in budgets.accelerators}
        if gpu_room and (found := split_device_map(module, gpu_room, size=size, dtype=dtype)) is not None:
            return found
    if valid:
        return merge_to_prefixes(assignment)
    found = split_device_map(module, _offload_room(budgets, limits, size), size=size, dtype=dtype)
    if found is not None:
        return found
    raise _does_not_fit(module, size, budgets, dtype, disk_allowed)


def _placeable_size(module, dtype) -> ComponentSize:
    """The module's size; without `_no_split_modules` it is one unit, placed whole."""
    size = size_module(module, dtype)
    if size.no_split_classes:
        return size
    return dataclasses.replace(
        size, split_units=(SplitUnit(path="", bytes=size.total),), no_split_classes=(type(module).__name__,)
    )


def _targets(module, strategy, budgets: Budgets, size, dtype) -> dict[Device, int | None]:
    """Per-device room accelerate should fill: the budgets, or for balanced strategies accelerate's
    balanced share per accelerator (computed on accelerators renamed 0..n-1: by key, not position)."""
    targets = dict(budgets.limits)
    accelerators = [d for d in budgets.accelerators if budgets.limit(d) > 0]
    if strategy == "sequential" or not accelerators:
        return targets
    aliased = {alias: budgets.limit(device) for alias, device in enumerate(accelerators)}
    aliased["cpu"] = budgets.limit("cpu")
    with quiet_accelerate():
        balanced = get_balanced_memory(
            module,
            max_memory=aliased,
            no_split_module_classes=list(size.no_split_classes),
            dtype=dtype,
            special_dtypes=fp32_kept_tensors(module, dtype) or None,
            low_zero=strategy == "balanced_low_0",
        )
    for alias, device in enumerate(accelerators):
        targets[device] = int(balanced[alias])
    return targets


def _accelerate_assignment(module, targets, size, dtype) -> dict[str, Device] | None:
    """accelerate's map over accelerators (renamed 0..n-1), then "cpu" (and its unlimited "disk"), as units."""
    accelerators = [d for d in targets if is_accelerator(d)]
    aliases = {alias: device for alias, device in enumerate(accelerators)}
    room = {alias: targets[device] for alias, device in aliases.items()}
    room["cpu"] = targets["cpu"]
    raw = accelerate_device_map(module, room, size, dtype)
    return assign_units({key: aliases.get(device, device) for key, device in raw.items()}, size.split_units)


def _fits(assignment, units, limits) -> bool:
    used: dict[Device, int] = {}
    for unit in units:
        device = assignment[unit.path]
        if device not in limits:
            return False
        used[device] = used.get(device, 0) + unit.bytes
    return all(limits[d] is None or used[d] <= limits[d] for d in used)


def _uses_host(assignment) -> bool:
    return any(device in HOST_DEVICES for device in assignment.values())


def _unique(*rooms):
    seen = []
    for room in rooms:
        if room not in seen:
            seen.append(room)
            yield room


def _offload_room(budgets: Budgets, limits, size) -> dict[Device, int]:
    """Exact packing room when something must leave the accelerators: the first execution device keeps room
    for the largest unit (offloaded weights are streamed onto it to run); an unlimited disk holds everything."""
    room = {d: (size.total if limit is None else limit) for d, limit in limits.items()}
    executor = budgets.accelerators[0] if budgets.accelerators else "cpu"
    room[executor] = max(0, room[executor] - size.largest_unit)
    return room


def _does_not_fit(module, size, budgets: Budgets, dtype, disk_allowed) -> Exception:
    name = type(module).__name__
    parts = ", ".join(
        f"{device_label(d)} {format_bytes(limit) if limit is not None else 'unlimited'}"
        for d, limit in budgets.limits.items()
        if d != "disk" or disk_allowed
    )
    needs = f"{name} needs {format_bytes(size.total)}{_dtype_note(dtype)} (largest block {format_bytes(size.largest_unit)})"
    if not disk_allowed:
        return OffloadFolderRequiredError(
            f"{needs}; the budgets ({parts}) cannot hold it without the disk. Pass offload_folder=... to offload "
            "the rest to disk, or a larger max_memory."
        )
    return DoesNotFitError(f"{needs}; it does not fit the budgets ({parts}). Pass a larger max_memory.")


def _explicit_map(module, device_map: Mapping, max_memory, dtype, disk_allowed) -> dict[str, Device]:
    """Validate a user's `{path: device}`: known paths, known devices, every tensor placed, budgets kept."""
    name = type(module).__name__
    tensors = [tensor_name for tensor_name, _ in named_module_tensors(module, recurse=True)]
    known = {path for path, _ in module.named_modules()} | set(tensors)
    result: dict[str, Device] = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise StrategyError(f"device_map key {key!r} is not a submodule or tensor of {name}.{hint}")
        try:
            result[key] = normalize_device(value)
        except InvalidDeviceError as error:
            raise InvalidDeviceError(f"device_map[{key!r}]: {error}") from None
    owners = {tensor: owning_key(tensor, result) for tensor in tensors}
    missing = [tensor for tensor, owner in owners.items() if owner is None]
    if missing:
        raise StrategyError(
            f"device_map for {name} gives no device to {len(missing)} tensor(s) ({', '.join(missing[:5])}"
            f"{f', and {len(missing) - 5} more' if len(missing) > 5 else ''}). Add keys covering them "
            "(the key \"\" covers everything else)."
        )
    if "disk" in result.values() and not disk_allowed:
        on_disk = [key for key, device in result.items() if device == "disk"]
        raise OffloadFolderRequiredError(
            f"device_map for {name} puts {', '.join(on_disk)} on 'disk' but no offload_folder was given; pass one."
        )
    if max_memory is not None:
        placed = {tensor: result[owner] for tensor, owner in owners.items()}
        _check_explicit_budgets(name, placed, resolve_budgets(max_memory), size_module(module, dtype), dtype)
    return result


def _check_explicit_budgets(name, placed, budgets: Budgets, size: ComponentSize, dtype) -> None:
    used: dict[Device, int] = {}
    for tensor, device in placed.items():
        used[device] = used.get(device, 0) + size.module_sizes.get(tensor, 0)  # a tied copy is absent: 0
    for device, total in used.items():
        limit = budgets.limits.get(device)
        if limit is not None and total > limit:
            raise DoesNotFitError(
                f"device_map for {name} puts {format_bytes(total)}{_dtype_note(dtype)} on {device_label(device)}, whose "
                f"max_memory is {format_bytes(limit)}. Move some modules elsewhere or raise max_memory."
            )


def _dtype_note(dtype) -> str:
    return f" ({str(dtype).removeprefix('torch.')})" if dtype is not None else ""


