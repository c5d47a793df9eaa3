"""The plan that moves the fewest bytes per call, for pipelines that do not fit resident (`transfers.search`).

`place_by_residency` evaluates the level x home candidates of `transfers.search` on copies of the strategy's
starting ledger and builds the best one: WHOLE components whole (or split along their blocks) on the
accelerator with the most room, FILL components partly resident (`transfers.fill`), and every component that
is not wholly resident executing on the home accelerator with its weights in CPU RAM (on disk when RAM is
short and an offload folder is given). Each component kept off the accelerators' resident room on purpose
gets a fallback (`demoted`) that says what it keeps resident and what it moves per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..cost import PlanCost
from ..device_maps import merge_to_prefixes
from ..devices import device_label
from ..memory_model import Ledger
from ..plan_schema import Fallback, PlacementKind
from ..sizes import format_bytes
from ..transfers.fill import Filled
from ..transfers.search import (
    Choice, Evaluated, Level, choices, fill_and_split, lower_bound, priority_order, reserve_phases,
)
from .fallbacks import place_whole, try_split
from .request import ComponentRequest, Placed, Placements, component_plan
from .state import PlacementState, StrategyRequest


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """The ledger and placements once the home's phases are reserved and the WHOLE components placed."""

    ledger: Ledger
    whole: dict  # name -> Placed, pinned ones included, in placement order


def place_by_residency(request: StrategyRequest, *, low_0: bool) -> Optional[tuple[PlacementState, PlanCost]]:
    """The cheapest candidate that executes every component on an accelerator, or None when none does."""
    search = _Search(request, low_0=low_0)
    best: Optional[Evaluated] = None
    for choice in choices(search.order, search.homes, search.runs):
        if best is not None and lower_bound(search.order, choice.levels, search.runs) > best.cost.transfer_bytes:
            break  # the choices come cheapest bound first: none left can beat the best
        evaluated = search.evaluate(choice)
        if evaluated is not None and (best is None or evaluated.cost < best.cost):
            best = evaluated
    return None if best is None else (search.materialize(best), best.cost)


class _Search:
    def __init__(self, request: StrategyRequest, *, low_0: bool):
        self.request = request
        self.runs = request.costs.runs
        self.order = priority_order(request.requests, self.runs)
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
        cost = self.request.costs.of(cpu_bytes=0, transfer_bytes=moved, executing=executing, ledger=ledger)
        return Evaluated(choice=choice, cost=cost, ledger=ledger, whole=stage.whole, filled=filled, hosts=hosts,
                         splits=splits)

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

    def materialize(self, best: Evaluated) -> PlacementState:
        placements = Placements(by_name=dict(best.whole))
        by_name = {r.name: r for r in self.order}
        levels = dict(zip((r.name for r in self.order), best.choice.levels))
        # Resident ones first, then those kept partly off the accelerators (demoted): FILL, then STREAM.
        ordered = sorted(best.filled, key=lambda name: (bool(best.filled[name].host), levels[name] is Level.STREAM))
        for name in ordered:
            request, filled = by_name[name], best.filled[name]
            placements.add(_placed(request, filled, best, self.runs.get(name, 1)))
        headline = (
            "The components do not all fit resident beside each other's phases: of the plans that execute "
            "everything on an accelerator, this one moves the fewest bytes per call "
            f"({format_bytes(best.cost.transfer_bytes)}, host -> accelerator, steady state), what runs most keeping "
            "its room; the components with weights "
            f"in host memory execute on {device_label(best.choice.home)}."
        )
        return PlacementState.of(best.ledger, placements, map_reasons=(headline,))


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


def _placed(request: ComponentRequest, filled: Filled, best: Evaluated, runs: int) -> Placed:
    home, host = best.choice.home, best.hosts.get(request.name)
    units = {unit.path: device for device, taken in filled.resident.items() for unit in taken}
    units.update({unit.path: host for unit in filled.host})
    # In execution order: interleaved resident and host-homed blocks read as they run (`transfers.interleave`).
    units = dict(sorted(units.items(), key=lambda item: request.unit_rank.get(item[0], len(request.unit_rank))))
    placed = {device: filled.resident_bytes(device) for device in filled.resident}
    if host is not None:
        placed[host] = sum(unit.bytes for unit in filled.host)
    split = best.splits[request.name]
    if host is None:
        kind = PlacementKind.WHOLE if len(placed) == 1 else PlacementKind.SPLIT
    else:
        kind = PlacementKind.OFFLOADED if host == "cpu" else PlacementKind.DISK
    plan = component_plan(request, kind=kind, device_map=merge_to_prefixes(units), execution_device=home,
                          placed_bytes=placed, streamed_unit_bytes=split.phase_weights)
    if kind is PlacementKind.WHOLE:
        return Placed(plan=plan)
    return Placed(plan=plan, fallback=Fallback(component=request.name, kind=kind, demoted=host is not None,
                                               reason=_reason(request, filled, split, runs, best)))


def _reason(request: ComponentRequest, filled: Filled, split, runs: int, best: Evaluated) -> str:
    resident = ", ".join(f"{format_bytes(filled.resident_bytes(d))} resident on {device_label(d)}"
                         for d in filled.resident)
    runs_text = f"runs {runs} times per call" if runs > 1 else "runs once per call"
    moved = split.bytes_per_call(runs)
    if not filled.host:
        return (f"{request.needs()} and {runs_text}; no accelerator holds it whole beside the other phases, so "
                f"it is split along its blocks: {resident}.")
    where = "CPU RAM" if best.hosts[request.name] == "cpu" else "on disk"
    kept = (f"It keeps {resident} (as much as the other components' phases leave room for); the rest"
            if filled.resident else "It")
    return (
        f"{request.needs()} and {runs_text}. {kept} lives in {where} and comes to "
        f"{device_label(best.choice.home)} in its phase: {format_bytes(split.loaded_bytes)} loaded once per call, "
        f"{format_bytes(split.streamed_bytes)} streamed block by block at each run ({format_bytes(moved)} per "
        f"call). Of the plans that execute everything on an accelerator, this one moves the fewest bytes per "
        f"call ({format_bytes(best.cost.transfer_bytes)} in all)."
    )
