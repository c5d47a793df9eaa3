"""Evaluating a residency-level option (`options.Choice`) on a copy of the strategy's starting ledger.

WHOLE components go whole (or split along their blocks) on the accelerator with the most room once the home
keeps room for the other components' phases; FILL components keep partly resident what those phases leave room
for (`transfers.fill`); every component that is not wholly resident executes on the home accelerator with its
weights in CPU RAM (on disk when RAM is short and an offload folder is given), its host-homed part split into
loaded-per-call and streamed units in its phase's room (`transfers.host_split`). The evaluation keeps what the
winner's plan is built from (`search_plans.residency_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..cost import PlanCost, minimum_phase_weights
from ..memory_model import Ledger
from ..transfers.fill import Filled, fill_resident
from ..transfers.host_split import HostSplit, split_host_part
from ..transfers.rooms import away_rooms, phase_room
from .fallbacks import place_whole, try_split
from .options import Choice, Level
from .request import ComponentRequest, Placed, Placements
from .search_plans import residency_state
from .state import PlacementState, StrategyRequest


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """One option, evaluated: its cost, the ledger, the resident placements and each other component's units."""

    choice: Choice
    cost: PlanCost
    ledger: Ledger
    whole: dict  # name -> Placed (WHOLE components, and the pinned ones placed before)
    filled: dict[str, Filled]  # FILL and STREAM components, in priority order
    hosts: dict[str, str]  # "cpu" or "disk", per component with host-homed units
    splits: dict[str, HostSplit]
    timed: bool = False  # the cost counts exposed copy seconds (FLOPs known), not only bytes


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """The ledger and placements once the home's phases are reserved and the WHOLE components placed."""

    ledger: Ledger
    whole: dict  # name -> Placed, pinned ones included, in placement order


class Residency:
    """The residency options of one request: their homes, and the stages and splits they share."""

    def __init__(self, request: StrategyRequest, order: Sequence[ComponentRequest], *, low_0: bool):
        self.request = request
        self.runs = request.costs.runs
        self.order = order
        accelerators = request.ledger.accelerators
        kept = [d for d in accelerators if not (low_0 and d == 0 and len(accelerators) > 1)]
        self.homes = kept
        self.device_order = kept + [d for d in accelerators if d not in kept]
        self.stages: dict = {}
        self.splits: dict = {}  # STREAM components' host splits by room (`fill_and_split`)

    def evaluate(self, choice: Choice) -> Optional[Evaluated]:
        stage = self._stage(choice)
        if stage is None:
            return None
        ledger = stage.ledger.copy()
        settled = fill_and_split(ledger, choice, self.order, self.runs, cache=self.splits)
        if settled is None:
            return None
        filled, splits = settled
        hosts = _charge_hosts(ledger, filled, self.request.context.has_offload_folder)
        if hosts is None:
            return None
        executing = {name: placed.plan.execution_device for name, placed in stage.whole.items()}
        executing.update({name: choice.home for name in filled})
        moved = sum(split.bytes_per_call(self.runs.get(name, 1)) for name, split in splits.items())
        cost = self.request.costs.of(cpu_bytes=0, transfer_bytes=moved, executing=executing, ledger=ledger,
                                     exposed_seconds=self._exposed(splits, hosts))
        return Evaluated(choice=choice, cost=cost, ledger=ledger, whole=stage.whole, filled=filled, hosts=hosts,
                         splits=splits, timed=self.request.costs.timing is not None)

    def _exposed(self, splits: dict[str, HostSplit], hosts: dict[str, str]) -> float:
        """The option's copy seconds compute does not hide (`cost.Timing`); 0 when no FLOPs are known."""
        timing = self.request.costs.timing
        if timing is None:
            return 0.0
        sizes = {r.name: r.bytes for r in self.order}
        return timing.total(timing.exposed(
            name, weight_bytes=sizes[name], loaded=split.loaded_bytes, streamed=split.streamed_bytes,
            blocks=len(split.streamed_paths), runs=self.runs.get(name, 1), disk=hosts.get(name) == "disk")
            for name, split in splits.items() if split.bytes_per_call(self.runs.get(name, 1)))

    def materialize(self, best: Evaluated) -> PlacementState:
        return residency_state(best, self.order, self.runs)

    def _stage(self, choice: Choice) -> Optional[_Stage]:
        key = (tuple(level is Level.WHOLE for level in choice.levels), choice.home)
        if key not in self.stages:
            self.stages[key] = self._build_stage(choice)
        return self.stages[key]

    def _build_stage(self, choice: Choice) -> Optional[_Stage]:
        ledger, placements = self.request.start()
        if not reserve_phases(ledger, choice, self.order):
            return None
        whole = [r for r, level in zip(self.order, choice.levels) if level is Level.WHOLE]
        for component in sorted(whole, key=lambda r: (-r.bytes, r.position)):
            placed = self._resident(component, ledger)
            if placed is None:
                return None
            placements.add(placed)
        return _Stage(ledger=ledger, whole=dict(placements.by_name))

    def _resident(self, component: ComponentRequest, ledger: Ledger) -> Optional[Placed]:
        """Whole on the accelerator with the most room (GPU 0 first among equals), else split; else None."""
        order = sorted(self.device_order, key=lambda d: (d not in self.homes,
                                                         -(ledger.room(d, transient=component.transient) or 0), d))
        for device in order:
            if ledger.fits(device, weights=component.bytes, transient=component.transient):
                return place_whole(component, ledger, device)
        why = f"{component.needs()}; no accelerator has room for it whole beside the other phases."
        return try_split(component, ledger, order, why, self.request.context)


def _charge_hosts(ledger: Ledger, filled: dict[str, Filled], disk_allowed: bool) -> Optional[dict[str, str]]:
    """Host-homed units in CPU RAM (the disk when RAM is short and allowed); None when neither has room."""
    hosts = {}
    for name, found in filled.items():
        size = sum(unit.bytes for unit in found.host)
        if not found.host:
            continue
        if ledger.fits("cpu", weights=size):
            hosts[name] = "cpu"
        elif disk_allowed and ledger.has("disk") and ledger.fits("disk", weights=size):
            hosts[name] = "disk"
        else:
            return None
        ledger.add(hosts[name], weights=size)
    return hosts


def fill_and_split(ledger: Ledger, choice: Choice, order: Sequence, runs, *,
                   cache: Optional[dict] = None) -> Optional[tuple[dict[str, Filled], dict[str, HostSplit]]]:
    """FILL components' resident units (priority order), then every non-resident part's per-call / streamed
    split in its phase (on the home, and for blocks that may run elsewhere on the other accelerators: `rooms`);
    None when a phase does not fit. `cache` keeps the splits of STREAM
    components (all of their units on the host) by room, across candidates."""
    cache = {} if cache is None else cache
    filled: dict[str, Filled] = {}
    for request, level in zip(order, choice.levels):
        if level is Level.FILL:  # resident room for the blocks the call runs; the idle ones stay on the host
            filled[request.name] = fill_resident(
                ledger, name=request.name, units=request.active_units, activation=request.transient,
                home=choice.home, devices=ledger.accelerators, spread=request.spread_blocks,
                in_order=choice.in_order)
            filled[request.name].host.extend(u for u in request.layout_units if u.path in request.idle)
        elif level is Level.STREAM:
            filled[request.name] = Filled(host=list(request.layout_units))
    splits = {}
    for request in order:
        if request.name not in filled:
            continue
        room, away = phase_room(ledger, choice.home, request), away_rooms(ledger, request, choice.home)
        host = sorted(filled[request.name].host, key=lambda unit: request.unit_rank[unit.path])  # unit order
        key = (request.name, room, away) if len(host) == len(request.layout_units) else None
        split = cache.get(key) if key else None
        if split is None:
            split = split_host_part(host, runs=runs.get(request.name, 1), room=room, idle=request.idle, away=away,
                                    spread=request.spread_blocks)
            if key:
                cache[key] = split
        if not split.fits:
            return None
        settle_phases(ledger, request, choice.home, split)
        splits[request.name] = split
    return filled, splits


def settle_phases(ledger: Ledger, request, home, split: HostSplit) -> None:
    """The component's phase on its execution device (activations, what it loads there, blocks in flight) and
    on each accelerator it loads blocks per call onto (activations and those blocks)."""
    ledger.set_phase(home, request.name, request.transient + split.phase_weights)
    for device, loaded in split.away_bytes().items():
        ledger.set_phase(device, request.name, request.transient + loaded)


def reserve_phases(ledger: Ledger, choice: Choice, order: Sequence) -> bool:
    """Room on the home for the least each non-resident component needs in its phase; False if it lacks it."""
    for request, level in zip(order, choice.levels):
        if level is Level.WHOLE:
            continue
        need = request.transient + minimum_phase_weights(request.active_units)
        if not ledger.fits(choice.home, weights=0, transient=need):
            return False
        ledger.add(choice.home, transient=need, phase=request.name)
    return True
