"""Model-level strategies: one model's submodules placed with accelerate's meaning of `device_map=` ("auto",
"balanced", "balanced_low_0", "sequential", a validated dict), through `infer_auto_device_map` with corrections:
our sizes checked against the real budgets; accelerators renamed 0..n-1 (accelerate reads `max_memory[0]` by
position); no `_no_split_modules`: placed whole; an exact split when accelerate offloads weights that fit.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Mapping

from accelerate.utils import get_balanced_memory
from accelerate.utils.modeling import named_module_tensors

from ..budgets import Budgets
from ..device_maps import merge_to_prefixes, owning_key
from ..devices import HOST_DEVICES, Device, device_label, is_accelerator, normalize_device
from ..errors import DoesNotFitError, InvalidDeviceError, PlanError
from ..memory_model import Ledger
from ..plan_schema import Fallback, PlacementKind
from ..sizes import format_bytes
from ..sizing import ComponentSize, SplitUnit, fp32_kept_tensors
from ..splitting import accelerate_device_map, assign_units, quiet_accelerate, split_device_map
from .state import (ComponentRequest, Placed, PlacementState, StrategyKind, StrategyRequest, StrategySpec, charge,
                    component_plan)


def place_model(spec: StrategySpec, request: ComponentRequest, budgets: Budgets, *, disk_allowed: bool) -> Placed:
    """Where `request`'s submodules go under the model-level strategy `spec`; nothing is mutated."""
    if spec.kind is StrategyKind.DICT:
        device_map = _explicit_map(request, spec.pins, budgets, disk_allowed)
    else:
        device_map = _strategy_map(request, spec.kind.value, budgets, disk_allowed)
    return _placed(request, device_map, spec, budgets)


def place_model_level(request: StrategyRequest) -> PlacementState:
    """The registry's model-scope strategy: each requested model placed by `place_model`, charged to a copy."""
    ledger, placements = request.start()
    budgets = budgets_of(request.ledger)
    for component in request.requests:
        placed = place_model(request.spec, component, budgets, disk_allowed=request.context.has_offload_folder)
        placements.add(charge(ledger, placed, component))
    return PlacementState.of(ledger, placements)


def budgets_of(ledger: Ledger) -> Budgets:
    """The budgets a ledger was built from (before anything was charged)."""
    return Budgets(limits={d: load.budget for d, load in ledger.loads.items()},
                   detected=frozenset(d for d, load in ledger.loads.items() if load.detected))


def _strategy_map(request: ComponentRequest, strategy: str, budgets: Budgets, disk_allowed: bool) -> dict:
    module, dtype = request.module, request.dtype
    size = _placeable_size(request.size, type(module).__name__)
    limits = {d: limit for d, limit in budgets.limits.items() if d != "disk" or disk_allowed}
    targets = _targets(module, strategy, budgets, size, dtype)
    assignment = _accelerate_assignment(module, targets, size, dtype)
    valid = assignment is not None and _fits(assignment, size.split_units, limits)
    if valid and not any(device in HOST_DEVICES for device in assignment.values()):
        return merge_to_prefixes(assignment)
    rooms = [targets] if targets == budgets.limits else [targets, budgets.limits]
    for room in rooms:  # accelerate offloaded: do the weights fit the GPUs alone?
        gpu_room = {d: room[d] for d in budgets.accelerators}
        if gpu_room and (found := split_device_map(module, gpu_room, size=size, dtype=dtype)) is not None:
            return found
    if valid:
        return merge_to_prefixes(assignment)
    found = split_device_map(module, _offload_room(budgets, limits, size), size=size, dtype=dtype)
    if found is not None:
        return found
    raise _does_not_fit(request, size, budgets, disk_allowed)


def _placeable_size(size: ComponentSize, class_name: str) -> ComponentSize:
    """The model's size; without `_no_split_modules` it is one unit (its own class never split), placed whole."""
    if size.declares_no_split:
        return size
    whole = (SplitUnit(path="", bytes=size.total),)
    return dataclasses.replace(size, split_units=whole, no_split_classes=(class_name,))


def _targets(module, strategy: str, budgets: Budgets, size: ComponentSize, dtype) -> dict[Device, int | None]:
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


def _accelerate_assignment(module, targets, size: ComponentSize, dtype) -> dict[str, Device] | None:
    """accelerate's map over accelerators (renamed 0..n-1), then "cpu" (and its unlimited "disk"), as units."""
    accelerators = [d for d in targets if is_accelerator(d)]
    aliases = dict(enumerate(accelerators))
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


def _offload_room(budgets: Budgets, limits, size: ComponentSize) -> dict[Device, int]:
    """Exact packing room when something must leave the accelerators: the first execution device keeps room
    for the largest unit (offloaded weights are streamed onto it to run); an unlimited disk holds everything."""
    room = {d: (size.total if limit is None else limit) for d, limit in limits.items()}
    executor = budgets.accelerators[0] if budgets.accelerators else "cpu"
    room[executor] = max(0, room[executor] - size.largest_unit)
    return room


def _does_not_fit(request: ComponentRequest, size: ComponentSize, budgets: Budgets, disk_allowed) -> Exception:
    parts = ", ".join(
        f"{device_label(d)} {format_bytes(limit) if limit is not None else 'unlimited'}"
        for d, limit in budgets.limits.items()
        if d != "disk" or disk_allowed
    )
    needs = f"{request.needs()} (largest block {format_bytes(size.largest_unit)})"
    if not disk_allowed:
        return DoesNotFitError(
            f"{needs}; the budgets ({parts}) cannot hold it without the disk. Pass offload_folder=... to offload "
            "the rest to disk, or a larger max_memory."
        )
    return DoesNotFitError(f"{needs}; it does not fit the budgets ({parts}). Pass a larger max_memory.")


def _explicit_map(request: ComponentRequest, pins: Mapping, budgets: Budgets, disk_allowed: bool) -> dict:
    """A user's `{path: device}`, validated: known paths, known devices, every tensor placed, budgets kept."""
    name = type(request.module).__name__
    tensors = [tensor_name for tensor_name, _ in named_module_tensors(request.module, recurse=True)]
    known = {path for path, _ in request.module.named_modules()} | set(tensors)
    result: dict[str, Device] = {}
    for key, value in pins.items():
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PlanError(f"device_map key {key!r} is not a submodule or tensor of {name}.{hint}")
        try:
            result[key] = normalize_device(value)
        except InvalidDeviceError as error:
            raise InvalidDeviceError(f"device_map[{key!r}]: {error}") from None
    owners = {tensor: owning_key(tensor, result) for tensor in tensors}
    missing = [tensor for tensor, owner in owners.items() if owner is None]
    if missing:
        raise PlanError(
            f"device_map for {name} gives no device to {len(missing)} tensor(s) ({', '.join(missing[:5])}"
            f"{f', and {len(missing) - 5} more' if len(missing) > 5 else ''}). Add keys covering them "
            "(the key \"\" covers everything else)."
        )
    if "disk" in result.values() and not disk_allowed:
        on_disk = [key for key, device in result.items() if device == "disk"]
        raise DoesNotFitError(
            f"device_map for {name} puts {', '.join(on_disk)} on 'disk' but no offload_folder was given; pass one."
        )
    placed = _bytes_per_device(request, result)
    _check_explicit_budgets(request, placed, budgets)
    return result


def _check_explicit_budgets(request: ComponentRequest, placed: Mapping[Device, int], budgets: Budgets) -> None:
    """A dict is the caller's choice: only budgets the caller gave (not detected ones) can refuse it."""
    for device, total in placed.items():
        limit = budgets.limits.get(device)
        if limit is not None and device not in budgets.detected and total > limit:
            dtype = f" ({request.dtype_name})" if request.dtype_name else ""
            raise DoesNotFitError(
                f"device_map for {type(request.module).__name__} puts {format_bytes(total)}{dtype} on "
                f"{device_label(device)}, whose max_memory is {format_bytes(limit)}. Move some modules elsewhere "
                "or raise max_memory."
            )


def _bytes_per_device(request: ComponentRequest, device_map: Mapping[str, Device]) -> dict[Device, int]:
    """Weight bytes per device; a tied copy is absent from the sizes and counts 0."""
    placed: dict[Device, int] = {}
    for tensor, _ in named_module_tensors(request.module, recurse=True):
        device = device_map[owning_key(tensor, device_map)]
        placed[device] = placed.get(device, 0) + request.size.module_sizes.get(tensor, 0)
    return placed


def _placed(request: ComponentRequest, device_map: dict, spec: StrategySpec, budgets: Budgets) -> Placed:
    placed = _bytes_per_device(request, device_map)
    in_order = _forward_order_devices(request, device_map)
    accelerators = [d for d in in_order if is_accelerator(d)]
    kind = _kind(accelerators, [d for d in placed if not is_accelerator(d)])
    # accelerate's model-level maps keep room for the largest block next to the resident part on the execution
    # device (`_offload_room`): that block, streamed in, is the transient to charge there.
    streamed = request.size.largest_unit if kind in (PlacementKind.OFFLOADED, PlacementKind.DISK) else 0
    plan = component_plan(
        request, kind=kind, device_map=device_map, execution_device=accelerators[0] if accelerators else "cpu",
        placed_bytes=placed, streamed_unit_bytes=streamed, pinned=spec.kind is StrategyKind.DICT,
    )
    if kind is PlacementKind.WHOLE or spec.kind is StrategyKind.DICT:
        return Placed(plan=plan)
    if kind is PlacementKind.CPU and not budgets.accelerators:
        return Placed(plan=plan)  # no accelerator to plan for: the CPU is the plan, not a fallback
    parts = ", ".join(f"{device_label(d)} {format_bytes(n)}" for d, n in plan.placed_bytes.items())
    rooms = ", ".join(f"{device_label(d)} {format_bytes(b) if b is not None else 'unlimited'}"
                      for d, b in budgets.limits.items())
    reason = (f"{request.needs()}; budgets {rooms}. Model-level {spec.kind.value!r} (accelerate's meaning) "
              f"placed it {kind.value}: {parts}, executing on {device_label(plan.execution_device)}.")
    return Placed(plan=plan, fallback=Fallback(component=request.name, kind=kind, reason=reason))


def _kind(accelerators: list[int], hosts: list[Device]) -> PlacementKind:
    if "disk" in hosts:
        return PlacementKind.DISK  # part on disk, served from the checkpoint to the execution device
    if accelerators and hosts:
        return PlacementKind.OFFLOADED  # part in CPU RAM, executed on the first accelerator
    if accelerators:
        return PlacementKind.WHOLE if len(set(accelerators)) == 1 else PlacementKind.SPLIT
    return PlacementKind.CPU


def _forward_order_devices(request: ComponentRequest, device_map: Mapping[str, Device]) -> list[Device]:
    """The devices in the order the forward reaches them (the first accelerator receives the inputs)."""
    owners = (owning_key(unit.path, device_map) for unit in request.size.split_units)
    seen = {device_map[key]: None for key in owners if key is not None}
    return list(seen) + [d for d in dict.fromkeys(device_map.values()) if d not in seen]
