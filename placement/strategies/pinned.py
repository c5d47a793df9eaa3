"""Pinned components, used as given and counted against the budgets: a dict strategy (the rest balanced around
it) or `pinned=` for components already dispatched (a fact: over a budget is a warning, not an error).
"""

from __future__ import annotations

import warnings
from typing import Mapping

from ..devices import Device, device_label, is_accelerator, normalize_device
from ..errors import DoesNotFitError, InvalidDeviceError, PlanError
from ..memory_model import Ledger
from ..plan_schema import PlacementKind
from ..sizes import format_bytes
from ..device_maps import owning_key
from .state import ComponentRequest, Placed, charge, component_plan


def normalize_pins(pins: Mapping, requests: Mapping[str, ComponentRequest], *,
                   source: str) -> dict[str, dict[str, Device]]:
    """`{component: {relative path: device}}`, every name, path and device checked; errors quote `source`."""
    unknown = [name for name in pins if name not in requests]
    if unknown:
        raise PlanError(
            f"{source} names components that do not exist: {unknown}. The module components are "
            f"{list(requests)}."
        )
    normalized = {}
    for name, spec in pins.items():
        if isinstance(spec, Mapping):
            device_map = {
                str(path): _device(value, source, f"{name}.{path}" if path else name) for path, value in spec.items()
            }
            _check_paths(device_map, requests[name], source)
        else:
            device_map = {"": _device(spec, source, name)}
        normalized[name] = device_map
    return normalized


def check_budgets_exist(pins: Mapping[str, Mapping[str, Device]], ledger: Ledger, *, source: str,
                        has_offload_folder: bool) -> None:
    for name, device_map in pins.items():
        for device in dict.fromkeys(device_map.values()):
            if not ledger.has(device):
                raise PlanError(
                    f"{source} puts {name!r} on {device_label(device)}, which has no budget: the devices are "
                    f"{list(ledger.loads)}. Add {device!r} to max_memory or pick one of those devices."
                )
            if device == "disk" and not has_offload_folder:
                raise DoesNotFitError(
                    f"{source} puts {name!r} (or part of it) on 'disk', and no offload_folder was given. "
                    "Pass offload_folder=... or pin it to another device."
                )


def place_pinned(request: ComponentRequest, device_map: Mapping[str, Device], ledger: Ledger) -> Placed:
    placed = _bytes_per_device(request, device_map)
    accelerators = [d for d in _module_order_devices(request, device_map) if is_accelerator(d)]
    hosts = [d for d in placed if not is_accelerator(d)]
    execution_device = accelerators[0] if accelerators else "cpu"
    kind = _kind(accelerators, hosts)
    streamed = request.streamed if hosts and accelerators else 0
    plan = component_plan(
        request, kind=kind, device_map=device_map, execution_device=execution_device, placed_bytes=placed,
        streamed_unit_bytes=streamed, pinned=True,
    )
    return charge(ledger, Placed(plan=plan), request)


def over_budget(ledger: Ledger, devices) -> list[tuple[str, Device]]:
    """("GPU 0: predicted 9.00 GiB > budget 8.00 GiB", 0) for every listed device over its budget."""
    found = []
    for device in dict.fromkeys(devices):
        budget = ledger.loads[device].budget
        peak = ledger.peak(device)
        if budget is not None and peak > budget:
            found.append((f"{device_label(device)}: predicted {format_bytes(peak)} > budget {format_bytes(budget)}", device))
    return found


def enforce(ledger: Ledger, devices, *, what: str, notes: list[str]) -> None:
    """A placement the caller asked for must fit: over an explicit budget is an error; over a detected
    one (free memory minus a margin: a guess) is a warning, since the caller named the devices."""
    problems = over_budget(ledger, devices)
    guessed = [p for p, d in problems if ledger.loads[d].detected]
    given = [p for p, d in problems if not ledger.loads[d].detected]
    if given:
        raise DoesNotFitError(
            f"{what} does not fit: {'; '.join(given)}. Pass a larger max_memory, put fewer components on "
            "these devices, or use device_map='balanced'."
        )
    for problem in guessed:
        message = f"{what} may not fit: {problem} (a detected budget)."
        warnings.warn(message, stacklevel=4)
        notes.append(message)


def _kind(accelerators: list[int], hosts: list[Device]) -> PlacementKind:
    if accelerators and hosts:
        return PlacementKind.OFFLOADED  # part in RAM or on disk, executed on the accelerator
    if accelerators:
        return PlacementKind.WHOLE if len(set(accelerators)) == 1 else PlacementKind.SPLIT
    return PlacementKind.DISK if "disk" in hosts else PlacementKind.CPU


def _device(value, source: str, where: str) -> Device:
    try:
        return normalize_device(value)
    except InvalidDeviceError as error:
        raise PlanError(f"{source}[{where!r}]: {error}") from None


def _tensor_names(request: ComponentRequest) -> list[str]:
    module = request.module
    return [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]


def _check_paths(device_map: Mapping[str, Device], request: ComponentRequest, source: str) -> None:
    known = request.size.module_sizes
    missing = [path for path in device_map if path not in known and not _is_submodule(request, path)]
    if missing:
        top = sorted({key.split(".")[0] for key in known if key})[:12]
        raise PlanError(
            f"{source} for {request.name!r} names submodules that do not exist: {missing}. "
            f"Its top-level submodules are {top}."
        )
    uncovered = [name for name in _tensor_names(request) if owning_key(name, device_map) is None]
    if uncovered:
        raise PlanError(
            f"{source} for {request.name!r} leaves {len(uncovered)} tensors without a device, e.g. "
            f"{uncovered[:5]}. Map their modules too, or map '' to a default device."
        )


def _is_submodule(request: ComponentRequest, path: str) -> bool:
    try:
        request.module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _bytes_per_device(request: ComponentRequest, device_map: Mapping[str, Device]) -> dict[Device, int]:
    if len(device_map) == 1 and "" in device_map:
        return {device_map[""]: request.bytes}
    placed: dict[Device, int] = {}
    for name in _tensor_names(request):
        device = device_map[owning_key(name, device_map)]
        placed[device] = placed.get(device, 0) + request.size.module_sizes.get(name, 0)
    return placed


def _module_order_devices(request: ComponentRequest, device_map: Mapping[str, Device]) -> list[Device]:
    """The devices in the order the forward reaches them (the first one receives the inputs)."""
    if len(device_map) == 1:
        return list(device_map.values())
    owners = (owning_key(unit.path, device_map) for unit in request.size.split_units)
    seen = {device_map[key]: None for key in owners if key is not None}
    return list(seen) or list(dict.fromkeys(device_map.values()))
