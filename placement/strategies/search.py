"""The one placement search (docs/design.md, "Strategies"): the strategy's own plan first, then the options that
keep components off the accelerators' resident room (`options`: demotions, residency levels x home), each pruned
by the least it can cost (`cost.least_cost`); the cheapest wins, ties to the one visited first. A pipeline that
fits resident is planned exactly as its strategy places it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Optional, Sequence

from ..cost import PlanCost, host_bytes, least_cost, minimum_phase_weights, stream_links
from ..device_maps import merge_to_prefixes
from ..devices import device_label, is_accelerator
from ..errors import PlacementError
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan, ComponentTransfer, Fallback, PlacementKind
from ..sizes import format_bytes
from ..time_model import seconds_text
from ..transfers.residency import Filled, HostSplit, fill_resident, pooled_split, settle_phases, split_host_part
from ..transfers.blocks import away_rooms, phase_room
from .fallbacks import place_streamed, place_whole, streamed_text, streaming_device, try_split
from .options import Choice, Level, demotion_sets, priority_order, residency_choices
from .state import (ComponentRequest, Context, Placed, PlacementState, Placements, Strategy, StrategyKind,
                    StrategyRequest, component_plan)


def residency_state(best: Evaluated, order: Sequence[ComponentRequest], runs: Mapping[str, int]) -> PlacementState:
    """The plan of a residency option: the pinned ones (placed before), the resident ones kept whole, the resident
    ones split, then the demoted ones: FILL, then STREAM. The non-WHOLE components' room was reserved on the home
    (`reserve_phases`) before any component was placed, so a split one is listed after those it was split beside."""
    by_name = {r.name: r for r in order}
    levels = dict(zip((r.name for r in order), best.choice.levels))
    placements = Placements(by_name={name: placed for name, placed in best.whole.items() if name not in by_name})
    built = {name: placed for name, placed in best.whole.items() if name in by_name}
    built.update({name: _placed(by_name[name], filled, best, runs.get(name, 1)) for name, filled in best.filled.items()})

    def listed(name: str) -> tuple:
        plan = built[name].plan
        return (host_bytes(plan) > 0, levels[name] is Level.STREAM,
                sum(1 for device in plan.placed_bytes if is_accelerator(device)) > 1)
    for name in sorted(built, key=listed):
        placements.add(built[name])
    headline = (
        "The components do not all fit resident beside each other's phases: of the plans that execute "
        f"everything on an accelerator, this one {_best_at(best)} "
        f"({format_bytes(best.cost.transfer_bytes)}, host -> accelerator, steady state), what runs most keeping "
        "its room; the components with weights "
        f"in host memory execute on {device_label(best.choice.home)}."
    )
    return PlacementState.of(best.ledger, placements, map_reasons=(headline,))


def _placed(request: ComponentRequest, filled: Filled, best: Evaluated, runs: int) -> Placed:
    home, host = best.choice.home, best.hosts.get(request.name)
    units = {unit.path: device for device, taken in filled.resident.items() for unit in taken}
    units.update({unit.path: host for unit in filled.host})
    # In execution order: interleaved resident and host-homed blocks read as they run (`transfers.blocks.moved_evenly`).
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
    if split.streamed_away:  # pooled: marks the transfer `complete_transfers` works out (`pooled_onto`)
        plan = plan.model_copy(update={"transfer": ComponentTransfer(streamed_devices=dict(split.streamed_away))})
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
        f"call). Of the plans that execute everything on an accelerator, this one {_best_at(best)} "
        f"({format_bytes(best.cost.transfer_bytes)} in all)."
    )


def _best_at(best: Evaluated) -> str:
    """What the residency option won by: bytes, or with FLOPs known, the copy seconds compute does not hide."""
    if not best.timed:
        return "moves the fewest bytes per call"
    return (f"leaves the fewest copy seconds exposed behind compute ({seconds_text(best.cost.exposed_seconds)} per "
            "call, bytes breaking ties), moving")


def explain_demotions(best: PlacementState, demoted: Sequence[ComponentRequest], base: Optional[PlacementState],
                      failure: Optional[PlacementError]) -> PlacementState:
    """Give every demoted component a fallback saying what it was, what ran on the CPU without it, the numbers."""
    base_plans = {} if base is None else {name: placed.plan for name, placed in base.by_name.items()}
    best_plans = {name: placed.plan for name, placed in best.by_name.items()}
    by_name = dict(best.by_name)
    after = _cpu_text(best_plans) or "nothing"
    if base is None:
        goal, before = "the plan fits at all", f"Without demotions planning fails ({failure})"
    else:
        goal = "no component runs on the CPU" if after == "nothing" else "less runs on the CPU"
        before = f"Without demotions these would execute on the CPU: {_cpu_text(base_plans)}"
    for request in demoted:
        plan = best_plans[request.name]
        what = _what(base_plans[request.name]) if base_plans else f"Demoted to streaming ({format_bytes(request.bytes)})"
        reason = (
            f"{what}, so that {goal}. {before}; on the CPU now: {after}. "
            f"{streamed_text(plan.devices[0], plan.execution_device, plan.streamed_unit_bytes)} Offloaded "
            "components on one device run one after another and share that room."
        )
        fallback = Fallback(component=request.name, kind=plan.kind, reason=reason, demoted=True)
        by_name[request.name] = Placed(plan=plan, fallback=fallback)
    return replace(best, by_name=MappingProxyType(by_name))


def _what(base: ComponentPlan) -> str:
    """What happened to a demoted component, from where the plan without demotions had it."""
    size = format_bytes(base.bytes)
    if base.kind is PlacementKind.WHOLE:
        return f"Demoted from whole on {device_label(base.execution_device)} ({size}) to offloaded"
    if base.kind is PlacementKind.SPLIT:
        return f"Demoted from split over {', '.join(device_label(d) for d in base.devices)} ({size}) to offloaded"
    if base.execution_device == "cpu":
        return f"Streamed to an accelerator ({size}) instead of running on the CPU, placed after the resident ones"
    return f"Streamed ({size}), placed after the components kept resident"


def _cpu_text(plans: dict[str, ComponentPlan]) -> str:
    """"text_encoder (9.00 GiB), vae (160 MiB)": the components that execute on the CPU."""
    return ", ".join(
        f"{name} ({format_bytes(plan.bytes)})" for name, plan in plans.items() if plan.execution_device == "cpu"
    )


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """One residency option, evaluated: what its plan is built from if it wins."""

    choice: Choice
    cost: PlanCost
    ledger: Ledger
    whole: dict  # name -> Placed (WHOLE components, and the pinned ones placed before)
    filled: dict[str, Filled]  # FILL and STREAM components, in priority order
    hosts: dict[str, str]  # "cpu" or "disk", per component with host-homed units
    splits: dict[str, HostSplit]
    timed: bool = False  # the cost counts exposed copy seconds (FLOPs known), not only bytes


class Residency:
    """The residency options of one request: WHOLE components go on the accelerator with the most room once the
    home keeps room for the others' phases; FILL ones keep resident what those phases leave; the host-homed rest
    executes on the home. Options share their stages (the ledger after the WHOLE ones) and STREAM splits."""

    def __init__(self, request: StrategyRequest, order: Sequence[ComponentRequest], *, low_0: bool):
        self.request = request
        self.runs = request.costs.runs
        self.order = order
        accelerators = request.ledger.accelerators
        kept = [d for d in accelerators if not (low_0 and d == 0 and len(accelerators) > 1)]
        self.homes = kept
        self.device_order = kept + [d for d in accelerators if d not in kept]
        self.by_name = {r.name: r for r in order}
        self.stages: dict = {}  # (WHOLE mask, home) -> (ledger, {name: Placed}) or None
        self.splits: dict = {}  # STREAM components' host splits by room (`fill_and_split`)

    def evaluate(self, choice: Choice) -> Optional[Evaluated]:
        key = (tuple(level is Level.WHOLE for level in choice.levels), choice.home)
        if key not in self.stages:
            self.stages[key] = self._stage(choice)
        if self.stages[key] is None:
            return None
        staged, whole = self.stages[key]
        ledger = staged.copy()
        settled = fill_and_split(ledger, choice, self.order, self.runs, cache=self.splits)
        if settled is None:
            return None
        filled, splits = settled
        hosts = _charge_hosts(ledger, filled, self.request.context.has_offload_folder, self.by_name)
        if hosts is None:
            return None
        executing = {name: placed.plan.execution_device for name, placed in whole.items()}
        executing.update({name: choice.home for name in filled})
        moved = sum(split.bytes_per_call(self.runs.get(name, 1)) for name, split in splits.items())
        cost = self.request.costs.of(cpu_bytes=0, transfer_bytes=moved, executing=executing, ledger=ledger,
                                     exposed_seconds=self._exposed(splits, hosts),
                                     spans=self._spans(whole, filled, splits, choice.home))
        return Evaluated(choice=choice, cost=cost, ledger=ledger, whole=whole, filled=filled, hosts=hosts,
                         splits=splits, timed=self.request.costs.timing is not None)

    def _spans(self, whole: dict, filled: dict[str, Filled], splits: dict[str, HostSplit], home: int) -> list:
        """The devices each component of the request spans (its weights, its execution, its per-call blocks): what
        `cost.split_components` counts. Pinned components, placed before, count in none."""
        ours = {r.name for r in self.order}
        spans = [placed.plan.placed_bytes for name, placed in whole.items() if name in ours]
        spans += [[*found.resident, home, *splits[name].away.values(), *splits[name].streamed_away.values()]
                  for name, found in filled.items()]
        return spans

    def _exposed(self, splits: dict[str, HostSplit], hosts: dict[str, str]) -> float:
        """The option's copy seconds compute does not hide; 0 when no FLOPs are known."""
        timing = self.request.costs.timing
        if timing is None:
            return 0.0
        sizes = {r.name: r.bytes for r in self.order}
        return timing.exposed(
            (name, sizes[name], split.loaded_bytes, split.streamed_bytes, len(split.streamed_paths),
             self.runs.get(name, 1), hosts.get(name),
             stream_links(split.streamed_away))
            for name, split in splits.items() if split.bytes_per_call(self.runs.get(name, 1)))

    def _stage(self, choice: Choice) -> Optional[tuple[Ledger, dict]]:
        """The ledger once the home's phases are reserved and the WHOLE components placed, and the placements."""
        ledger, placements = self.request.start()
        if not reserve_phases(ledger, choice, self.order):
            return None
        whole = [r for r, level in zip(self.order, choice.levels) if level is Level.WHOLE]
        for component in sorted(whole, key=lambda r: (-r.bytes, r.position)):
            placed = self._resident(component, ledger)
            if placed is None:
                return None
            placements.add(placed)
        return ledger, dict(placements.by_name)

    def _resident(self, component: ComponentRequest, ledger: Ledger) -> Optional[Placed]:
        """Whole on the accelerator with the most room (GPU 0 first among equals), else split; else None."""
        order = sorted(self.device_order, key=lambda d: (d not in self.homes,
                                                         -(ledger.room(d, transient=component.transient) or 0), d))
        for device in order:
            if ledger.fits(device, weights=component.bytes, transient=component.transient):
                return place_whole(component, ledger, device)
        why = f"{component.needs()}; no accelerator has room for it whole beside the other phases."
        return try_split(component, ledger, order, why, self.request.context)


def _charge_hosts(ledger: Ledger, filled: dict[str, Filled], disk_allowed: bool,
                  requests: Mapping[str, ComponentRequest]) -> Optional[dict[str, str]]:
    """Host-homed units in CPU RAM (the disk when RAM is short and allowed); None when neither has room, or when
    the component's format cannot run from there (`ComponentRequest.limit`)."""
    hosts = {}
    for name, found in filled.items():
        size = sum(unit.bytes for unit in found.host)
        if not found.host:
            continue
        hosts[name] = host_for(ledger, size, disk_allowed, requests[name])
        if hosts[name] is None:
            return None
        ledger.add(hosts[name], weights=size)
    return hosts


def host_for(ledger: Ledger, size: int, disk_allowed: bool, request: ComponentRequest) -> Optional[str]:
    """Where `size` bytes of `request`'s host-homed weights go: CPU RAM, else the disk when allowed (by the caller
    and by its format); None when neither fits."""
    if request.host_allowed("cpu") and ledger.fits("cpu", weights=size):
        return "cpu"
    if disk_allowed and request.host_allowed("disk") and ledger.has("disk") and ledger.fits("disk", weights=size):
        return "disk"
    return None


def fill_and_split(ledger: Ledger, choice: Choice, order: Sequence, runs, *,
                   cache: Optional[dict] = None) -> Optional[tuple[dict[str, Filled], dict[str, HostSplit]]]:
    """FILL components' resident units (priority order), then every non-resident part's per-call / streamed
    split in its phase rooms; None when a phase does not fit. `cache` keeps STREAM components' splits by room."""
    cache = {} if cache is None else cache
    filled: dict[str, Filled] = {}
    for request, level in zip(order, choice.levels):
        if level is Level.FILL:  # resident room for the blocks the call runs; the idle ones stay on the host
            filled[request.name] = fill_resident(
                ledger, name=request.name, units=request.active_units, activation=request.transient,
                home=choice.home, devices=ledger.accelerators, spread=request.spread_blocks,
                in_order=choice.in_order, reserve_on=_onto(ledger, choice))
            filled[request.name].host.extend(u for u in request.layout_units if u.path in request.idle)
        elif level is Level.STREAM:
            filled[request.name] = Filled(host=list(request.layout_units))
    splits = {}
    for request in order:
        if request.name not in filled:
            continue
        room, away = phase_room(ledger, choice.home, request), away_rooms(ledger, request, choice.home)
        host = sorted(filled[request.name].host, key=lambda unit: request.unit_rank[unit.path])  # unit order
        key = (request.name, room, away, choice.pooled) if len(host) == len(request.layout_units) else None
        split = cache.get(key) if key else None
        if split is None:
            split = _split(host, request, runs.get(request.name, 1), room, away, onto=_onto(ledger, choice))
            if key:
                cache[key] = split
        if not split.fits:
            return None
        settle_phases(ledger, request, choice.home, split)
        splits[request.name] = split
    if choice.pooled and not any(split.streamed_away for split in splits.values()):
        return None  # nothing can stream onto another accelerator: the option without `pooled` is this one
    return filled, splits


def _onto(ledger: Ledger, choice: Choice) -> Optional[int]:
    """Where a pooled option streams its blocks onto: the last accelerator other than the home (the last span's)."""
    others = [device for device in ledger.accelerators if device != choice.home]
    return others[-1] if choice.pooled and others else None


def _split(host, request, runs: int, room, away, *, onto: Optional[int]) -> HostSplit:
    """The host split; with `onto`, streamed onto that accelerator where that can be, else as without."""
    rooms = dict(runs=runs, room=room, idle=request.idle, away=away, spread=request.spread_blocks)
    found = pooled_split(host, onto=onto, **rooms) if onto is not None else None
    return found if found is not None else split_host_part(host, **rooms)


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


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A built state: the strategy's own, with `demoted` streamed."""

    cost: PlanCost
    state: PlacementState
    demoted: tuple[ComponentRequest, ...] = ()


def searched(strategy: Strategy, *, residency: bool) -> Strategy:
    """`strategy`, replaced by the cheapest option of the search when its own plan does not fit resident."""
    return partial(place_searched, strategy, residency=residency)


def place_searched(strategy: Strategy, request: StrategyRequest, *, residency: bool) -> PlacementState:
    """The cheapest candidate (see the module doc); a residency option is built only if it wins."""
    try:
        base, failure = demoted(strategy, request, ()), None
    except PlacementError as error:  # e.g. a component needs the disk and no offload folder was given
        base, failure = None, error
    if base is not None and base.cost.cpu_bytes == 0 and base.cost.transfer_bytes == 0:
        return base.state  # everything resident: nothing moves per call, nothing changes
    runs, ledger = request.costs.runs, request.ledger
    quick = replace(request, thorough=False)  # the tie-break cost never changes; the winner gets it
    levels = None
    if residency and ledger.accelerators and request.requests:
        levels = Residency(request, priority_order(request.requests, runs),
                           low_0=request.spec.kind is StrategyKind.BALANCED_LOW_0)

    def options() -> Iterator[tuple[PlanCost, Callable[[], Optional[Candidate | Evaluated]]]]:
        if (base is None or base.cost.cpu_bytes) and ledger.accelerators:
            pool = [r for r in request.requests if streaming_device(r, ledger, ledger.accelerators) is not None
                    and not r.refuses(PlacementKind.OFFLOADED)]
            for demoted_set in demotion_sets(pool, runs):
                yield least_cost(demoted_set, runs), partial(_demotion, strategy, quick, demoted_set)
        if levels is not None:
            for choice in residency_choices(levels.order, levels.homes, runs, pooled=len(ledger.accelerators) > 1):
                yield least_cost(choice.streamed(levels.order), runs), partial(levels.evaluate, choice)

    best = base
    for bound, build in options():
        if best is not None and best.cost <= bound:
            continue  # no candidate of this option can be cheaper than the best one
        candidate = build()
        if candidate is not None and (best is None or candidate.cost < best.cost):
            best = candidate
    if best is None:
        raise failure
    if isinstance(best, Evaluated):
        return residency_state(best, levels.order, runs)
    if best is base:
        return base.state
    best = demoted(strategy, request, best.demoted) or best  # the winner again, with every tie-break
    return explain_demotions(best.state, best.demoted, None if base is None else base.state, failure)


def _demotion(strategy: Strategy, request: StrategyRequest, demoted_set: tuple[ComponentRequest, ...]
              ) -> Optional[Candidate]:
    try:
        return demoted(strategy, request, demoted_set)
    except PlacementError:  # this arrangement fails too
        return None


def demoted(strategy: Strategy, request: StrategyRequest, demoted_set: tuple[ComponentRequest, ...]
            ) -> Optional[Candidate]:
    """The strategy over the others, then `demoted_set` streamed (largest working set first); None when one of
    them cannot run on an accelerator."""
    kept = [r for r in request.requests if all(r is not d for d in demoted_set)]
    state = strategy(replace(request, requests=tuple(kept))) if kept else PlacementState.of(*request.start())
    ledger = state.ledger.copy()
    placements = Placements(by_name=dict(state.by_name))
    for component in sorted(demoted_set, key=lambda r: (-(r.streamed + r.transient), r.position)):
        placed = _stream(component, ledger, request.context)
        if placed is None:
            return None
        placements.add(placed)
    cost = request.cost(placements.by_name, ledger)
    state = replace(state, ledger=ledger, by_name=PlacementState.of(ledger, placements).by_name)
    return Candidate(cost=cost, state=state, demoted=demoted_set)


def _stream(request: ComponentRequest, ledger: Ledger, context: Context) -> Optional[Placed]:
    """Weights in CPU RAM (or, when RAM is short, the offload folder), executed on an accelerator."""
    device = streaming_device(request, ledger, ledger.accelerators)
    host = host_for(ledger, request.bytes, context.has_offload_folder, request)
    if device is None or host is None:
        return None
    return place_streamed(request, ledger, host=host, execution_device=device, reason="")  # reason: explained
