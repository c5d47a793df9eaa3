"""What the search's winner becomes when it is not the strategy's own plan: its placements, and the fallback every
component kept off the accelerators' resident room on purpose gets (`demoted`), saying what it keeps resident,
what it moves per call and why.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from ..device_maps import merge_to_prefixes
from ..devices import device_label
from ..errors import PlacementError
from ..plan_schema import ComponentPlan, Fallback, PlacementKind
from ..sizes import format_bytes
from ..time_model import seconds_text
from .fallbacks import streamed_text
from .options import Level
from .request import ComponentRequest, Placed, Placements, component_plan
from .state import PlacementState

if TYPE_CHECKING:
    from ..transfers.fill import Filled
    from .levels import Evaluated


def residency_state(best: Evaluated, order: Sequence[ComponentRequest], runs: Mapping[str, int]) -> PlacementState:
    """The plan of a residency option: resident ones first, then those kept partly off the accelerators (demoted):
    FILL, then STREAM."""
    placements = Placements(by_name=dict(best.whole))
    by_name = {r.name: r for r in order}
    levels = dict(zip((r.name for r in order), best.choice.levels))
    ordered = sorted(best.filled, key=lambda name: (bool(best.filled[name].host), levels[name] is Level.STREAM))
    for name in ordered:
        request, filled = by_name[name], best.filled[name]
        placements.add(_placed(request, filled, best, runs.get(name, 1)))
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
