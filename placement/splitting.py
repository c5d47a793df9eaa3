"""Split one module over several devices along its split units, never cutting a `_no_split_modules` block.

Units are cut in execution order, so each device holds one run of consecutive units. accelerate's
`infer_auto_device_map` is asked first, but it reserves room for the largest layer, counts bools at 1/8 byte and
follows registration order: its answer is kept only when it is a valid contiguous split by our sizes, else the
exact greedy packing replaces it (optimal for units in a fixed order). With `balance=`, the packing whose fullest
device is least full is found by bisecting on that share, so one GPU is never at 98% while the next has room.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from accelerate import infer_auto_device_map
from accelerate.utils import find_tied_parameters
from torch import nn

from .activations.isolation import loggers_at_error
from .device_maps import merge_to_prefixes, owning_key, prefixes
from .devices import Device, normalize_device
from .sizing import ComponentSize, SplitUnit, fp32_kept_tensors

_ACCELERATE_LOGGERS = ("accelerate.utils.modeling", "accelerate")


def split_device_map(
    module: nn.Module,
    budgets: Mapping[Device, int],
    *,
    size: ComponentSize,
    dtype: torch.dtype | None = None,
    balance: Mapping[Device, int] | None = None,
) -> dict[str, Device] | None:
    """`{module path: device}` placing `module`'s split units over `budgets` (bytes, visited in the given
    order), or None when they cannot fit. Paths are relative to `module`, merged to the coarsest prefixes.
    `balance`: each device's whole budget; the pieces are then balanced (see the module doc)."""
    devices = [normalize_device(device) for device in budgets]
    room = {device: int(budgets[key]) for device, key in zip(devices, budgets)}
    if not devices or size.total > sum(room.values()) or size.largest_unit > max(room.values()):
        return None
    units = size.split_units
    tied_groups = _tied_unit_groups(module, units)
    attempts = (_accelerate_assignment, _greedy_assignment)
    if balance is not None:
        whole = {normalize_device(device): int(limit) for device, limit in balance.items()}
        attempts = (lambda *args: _balanced_assignment(*args, whole=whole), _greedy_assignment)
    for attempt in attempts:
        assignment = attempt(module, devices, room, size, dtype, units)
        if assignment is not None and _is_valid(assignment, units, room, tied_groups) and _is_contiguous(
            assignment, units
        ):
            return merge_to_prefixes(assignment)
    return None


def _accelerate_assignment(module, devices, room, size, dtype, units) -> dict[str, Device] | None:
    """accelerate's split, with the devices renamed 0..n-1 so that it visits them in our order (it sorts
    accelerator ints first, then "cpu") and never reserves a layer's room on a host device."""
    aliases = {alias: device for alias, device in enumerate(devices)}
    raw = accelerate_device_map(module, {alias: room[device] for alias, device in aliases.items()}, size, dtype)
    if any(device not in aliases for device in raw.values()):
        return None  # accelerate sent something to "disk": it found no split within the budgets
    return assign_units({key: aliases[alias] for key, alias in raw.items()}, units)


def accelerate_device_map(module: nn.Module, max_memory: Mapping, size: ComponentSize, dtype) -> dict:
    """accelerate's `infer_auto_device_map` for `module` at `dtype` (fp32-kept tensors included), its
    `_no_split_modules` blocks kept whole, without its warnings about absent devices."""
    with quiet_accelerate():
        return infer_auto_device_map(
            module,
            max_memory=max_memory,
            no_split_module_classes=list(size.no_split_classes),
            dtype=dtype,
            special_dtypes=fp32_kept_tensors(module, dtype) or None,
            offload_buffers=True,  # the map is the same; skips a per-module buffer sizing used only to warn
        )


def _greedy_assignment(module, devices, room, size, dtype, units) -> dict[str, Device] | None:
    """Exact contiguous packing: each device takes the longest run of the next units that fits."""
    assignment: dict[str, Device] = {}
    index, used = 0, 0
    for unit in units:
        while index < len(devices) and used + unit.bytes > room[devices[index]]:
            index, used = index + 1, 0
        if index == len(devices):
            return None
        assignment[unit.path] = devices[index]
        used += unit.bytes
    return assignment


def _balanced_assignment(module, devices, room, size, dtype, units, *, whole) -> dict[str, Device] | None:
    """The contiguous packing whose fullest device is least full as a share of its whole budget: a device at
    share s may take room - (1 - s) * budget of the pieces; the least s the greedy packing accepts, by bisection
    (to a thousandth of a percent)."""
    if any(device not in whole or whole[device] <= 0 for device in devices):
        return None

    def packing(share: float):
        caps = {d: min(room[d], int(room[d] - (1 - share) * whole[d])) for d in devices}
        return _greedy_assignment(module, devices, caps, size, dtype, units)

    low, high = 0.0, 1.0
    if packing(high) is None:
        return None
    for _ in range(24):
        middle = (low + high) / 2
        low, high = (low, middle) if packing(middle) is not None else (middle, high)
    return packing(high)


def assign_units(device_map: Mapping[str, Device], units: Sequence[SplitUnit]) -> dict[str, Device] | None:
    """Each unit's device under `device_map` (its longest matching prefix); None if a key cuts into a unit
    or a unit is not covered."""
    unit_paths = {unit.path for unit in units}
    for key in device_map:
        if any(prefix in unit_paths for prefix in prefixes(key)[:-1]):
            return None  # the key lies strictly inside a unit: that unit would be cut
    assignment: dict[str, Device] = {}
    for unit in units:
        owner = owning_key(unit.path, device_map)
        if owner is None:
            return None
        assignment[unit.path] = device_map[owner]
    return assignment


def _is_valid(assignment, units, room, tied_groups) -> bool:
    used = dict.fromkeys(room, 0)
    for unit in units:
        device = assignment[unit.path]
        if device not in used:
            return False
        used[device] += unit.bytes
    if any(used[device] > room[device] for device in room):
        return False
    return all(len({assignment[path] for path in group}) == 1 for group in tied_groups)


def _is_contiguous(assignment: Mapping[str, Device], units: Sequence[SplitUnit]) -> bool:
    """Each device holds one run of consecutive units: a forward in unit order enters each device once."""
    finished: set = set()
    current = None
    for unit in units:
        device = assignment[unit.path]
        if device != current:
            if device in finished:
                return False
            if current is not None:
                finished.add(current)
            current = device
    return True


def two_way_splits(module: nn.Module, size: ComponentSize, devices: tuple[Device, Device] = (0, 1)) -> list[dict]:
    """Every split of `module` over two devices the planner may choose, whatever the budgets: its units in
    execution order cut once between two of them, tied units kept together (`{path: device}`, merged)."""
    units = size.split_units
    tied_groups = _tied_unit_groups(module, units)
    splits = []
    for cut in range(1, len(units)):
        assignment = {unit.path: devices[index >= cut] for index, unit in enumerate(units)}
        if all(len({assignment[path] for path in group}) == 1 for group in tied_groups):
            splits.append(merge_to_prefixes(assignment))
    return splits


def _tied_unit_groups(module: nn.Module, units: Sequence[SplitUnit]) -> list[set[str]]:
    """Sets of unit paths that share a tied parameter and so must sit on one device."""
    groups = find_tied_parameters(module)
    unit_paths = {unit.path for unit in units}
    result = []
    for names in groups:
        owners = {owning_key(name, unit_paths) for name in names}
        if len(owners) > 1:
            result.append(owners)
    return result


@contextlib.contextmanager
def quiet_accelerate():
    """Silence accelerate's "Device 1 is not available" warnings: planning for absent GPUs is intended."""
    with loggers_at_error(*_ACCELERATE_LOGGERS):
        yield
