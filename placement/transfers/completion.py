"""Every component's transfer (`ComponentPlan.transfer`) from where its weights live, for any strategy.

Residency is what the strategy decided: the device-map entries naming an accelerator. The host-homed rest of
a component executing on an accelerator is split into loaded-per-call and streamed units (`host_split`) within
the room its own phase leaves on its execution device: the budget, less the overhead, the resident weights
there (everyone's: they stay in every phase) and its activations. Phases are independent once residency is
fixed (one component runs at a time), so each component is settled on its own. A component that loads blocks
per call has its phase in the ledger set to what it then holds (activations + loaded per call + blocks in
flight); one that streams every block keeps what its strategy charged (its streaming working set; at model
scope accelerate's one module at a time, which its hooks run with).

Host-homed units are read through the device map at module granularity (`streaming.transfer_units`); a map
that cuts finer than a unit (a pinned `{submodule: device}` map) is followed key by key inside it.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Mapping, Optional

from ..device_maps import owning_key
from ..devices import Device, is_accelerator
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan, ComponentTransfer
from ..streaming import TransferUnit
from .host_split import HostSplit, split_host_part
from .blocks import away_rooms, phase_room


def complete_transfers(state, requests: Mapping, runs: Mapping[str, int]):
    """`state` (a `strategies.PlacementState`) with every component's transfer filled and its phase settled."""
    ledger = state.ledger.copy()
    by_name = {}
    for name, placed in state.by_name.items():
        plan = placed.plan
        request = requests[name]
        transfer, split = component_transfer(plan, request, runs.get(name, 1), ledger)
        update: dict = {"transfer": transfer}
        if _loads_more(split) and ledger.has(plan.execution_device):  # untracked: a dict named a device
            ledger.set_phase(plan.execution_device, name, request.transient + split.phase_weights)
            for device, loaded in split.away_bytes().items():
                ledger.set_phase(device, name, request.transient + loaded)
            update["streamed_unit_bytes"] = split.phase_weights
        by_name[name] = replace(placed, plan=plan.model_copy(update=update))
    return replace(state, ledger=ledger, by_name=MappingProxyType(by_name))


def _loads_more(split: Optional[HostSplit]) -> bool:
    """Whether the split loads more per call than streaming needs (a component running several times, with
    room): only then does its phase grow past what the strategy charged, its streaming working set."""
    if split is None or not split.fits:
        return False
    return any(unit.block for unit in split.per_call)


def component_transfers(by_name: Mapping, requests: Mapping, ledger: Ledger,
                        runs: Mapping[str, int]) -> dict[str, ComponentTransfer]:
    """The transfer of each component in `requests` among the placements `by_name` (a name -> Placed mapping)
    under `ledger`: what `cost.CostModel.cost` prices."""
    return {name: component_transfer(by_name[name].plan, request, runs.get(name, 1), ledger)[0]
            for name, request in requests.items()}


def component_transfer(plan: ComponentPlan, request, runs: int,
                       ledger: Ledger) -> tuple[ComponentTransfer, Optional[HostSplit]]:
    """The component's transfer, and its host split (None when nothing host-homed runs on an accelerator),
    within the room its phase leaves (`rooms`: on its execution device and, spread, on the others)."""
    if not is_accelerator(plan.execution_device):
        return ComponentTransfer(runs_per_call=runs), None  # computes on the CPU: nothing crosses to a GPU
    resident = sum(n for device, n in plan.placed_bytes.items() if is_accelerator(device))
    host = host_units(plan.device_map, request)
    if not host:
        return ComponentTransfer(runs_per_call=runs, resident_bytes=resident), None
    home = plan.execution_device
    split = split_host_part(host, runs=runs, room=phase_room(ledger, home, request), idle=request.idle,
                            away=away_rooms(ledger, request, home) if ledger.has(home) else (),
                            spread=request.spread_blocks)
    transfer = ComponentTransfer(
        runs_per_call=runs, resident_bytes=resident, loaded_per_call_bytes=split.loaded_bytes,
        streamed_per_run_bytes=split.streamed_bytes, per_call_modules=[u.path for u in split.per_call],
        streamed_modules=split.streamed_paths, stream_buffer_bytes=split.buffer_bytes,
        per_call_devices=dict(split.away),
    )
    return transfer, split


def host_units(device_map: Mapping[str, Device], request) -> list[TransferUnit]:
    """The component's units (and pieces of units a finer map cuts) that `device_map` homes on the host."""
    if all(is_accelerator(device) for device in device_map.values()):
        return []
    keys = tuple(device_map)
    sizes = request.size.module_sizes
    found: list[TransferUnit] = []
    for unit in request.layout_units:
        owner = owning_key(unit.path, keys)
        _pieces(unit, None if owner is None else device_map[owner], device_map, keys, sizes, found)
    return found


def _pieces(unit: TransferUnit, owner: Optional[Device], device_map, keys, sizes, found: list) -> None:
    """The host-homed pieces of `unit`: keys strictly inside it are followed (recursively); what they leave
    belongs to the key that owns the unit."""
    inside = [key for key in keys if _strictly_inside(key, unit.path)]
    outermost = [key for key in inside if not any(_strictly_inside(key, other) for other in inside)]
    covered = 0
    for key in outermost:
        piece = TransferUnit(path=key, bytes=sizes.get(key, 0), block=unit.block)
        covered += piece.bytes
        _pieces(piece, device_map[key], device_map, keys, sizes, found)
    remaining = unit.bytes - covered
    if remaining > 0 and owner is not None and not is_accelerator(owner):
        found.append(TransferUnit(path=unit.path, bytes=remaining, block=unit.block))


def _strictly_inside(key: str, path: str) -> bool:
    if key == path:
        return False
    return key.startswith(f"{path}.") if path else bool(key)
