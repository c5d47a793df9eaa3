"""Nothing needlessly on the CPU: demote resident components to "offloaded" when that lets all execute on a GPU.

A strategy places components one at a time; one placed whole early can leave an accelerator's remaining room
smaller than a later component's streaming working set, and that component then runs on the CPU -- although
offloading the first one (weights in CPU RAM, streamed block by block) would let every component execute on
an accelerator: offloaded components on one device run one after another, so they share ONE streaming room
(the largest working set among them), where whole ones add up.

So when the strategy's own plan (the base) executes a component on the CPU while accelerators exist, other
plans are tried: for a set D of components, the strategy places the others, then each component of D is
streamed from CPU RAM (the disk when RAM is short) to the accelerator with the most room for its working set
(largest working set first). A candidate in which a component of D cannot execute on an accelerator is
dropped. The cheapest candidate (`cost.PlanCost`: bytes executing on the CPU, then bytes moved per call, then
crossing edges) is kept; ties go to the earliest.

D ranges over the subsets of the components that could stream at all (some accelerator can hold their working
set). Up to EXHAUSTIVE_LIMIT such components every subset is tried, smallest subsets first, and within a size
the least valuable components first (fewest runs per call, then smallest). Past it, the subsets are visited
best first: in increasing order of what demoting them costs at least (their bytes, each moved at least once per
call), and the search stops as soon as no unvisited subset can beat the best candidate found (whose cost is at
least its own demotion cost), or after BEST_FIRST_LIMIT candidates.
So the best resident set is found beyond 8 components too, not only nested prefixes. Both searches include
"all of them", which puts everything on an accelerator whenever one can hold the largest working set: the
guarantee the tests check.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from itertools import combinations
from types import MappingProxyType
from typing import Iterator, Optional, Sequence

from ..cost import CostModel, PlanCost, least_bytes_per_call
from ..devices import device_label
from ..errors import PlacementError
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan, Fallback, PlacementKind
from ..sizes import format_bytes
from .fallbacks import Context, place_streamed, streamed_text, streaming_device
from .request import ComponentRequest, Placed, Placements
from .state import PlacementState, Strategy, StrategyRequest

EXHAUSTIVE_LIMIT = 8  # 2**8 - 1 = 255 extra strategy runs at most (a run is milliseconds: splits are cached)
BEST_FIRST_LIMIT = 512  # candidates the best-first search runs at most past EXHAUSTIVE_LIMIT


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    demoted: tuple[ComponentRequest, ...]
    state: PlacementState
    cost: PlanCost


def with_demotions(strategy: Strategy) -> Strategy:
    """`strategy`, kept unless demoting components to streaming executes less on the CPU (see the module doc)."""

    def place(request: StrategyRequest) -> PlacementState:
        return place_with_demotions(strategy, request)

    place.__name__ = f"{getattr(strategy, '__name__', 'strategy')}_with_demotions"
    return place


def place_with_demotions(strategy: Strategy, request: StrategyRequest) -> PlacementState:
    """Run `strategy`; if it executes something on the CPU (or fails), keep the cheapest plan with demotions."""
    try:
        base, failure = _candidate(strategy, request, ()), None
    except PlacementError as error:  # e.g. no device can run a component whose weights must go to disk
        base, failure = None, error
    best = base
    ledger = request.ledger
    if (base is None or base.cost.cpu_bytes) and ledger.accelerators:
        pool = [r for r in request.requests if streaming_device(r, ledger, ledger.accelerators) is not None]
        best = _search(strategy, replace(request, thorough=False), pool, best)
    if best is None:
        raise failure
    if best is not base:
        best = _candidate(strategy, request, best.demoted) or best  # the winner again, with every tie-break
        return _explain_demotions(best, base, failure)
    return best.state


def _search(
    strategy: Strategy, request: StrategyRequest, pool: Sequence[ComponentRequest], best: Optional[_Candidate]
) -> Optional[_Candidate]:
    if len(pool) <= EXHAUSTIVE_LIMIT:
        sets: Iterator = candidate_sets(pool, request.costs)
    else:
        sets = best_first_sets(pool, request.costs)
    for tried, (demoted, at_least) in enumerate(_with_bounds(sets, request.costs)):
        if len(pool) > EXHAUSTIVE_LIMIT and (tried >= BEST_FIRST_LIMIT or (best is not None and best.cost <= at_least)):
            break  # no set left can be cheaper than the best candidate (or the search has run long enough)
        best = _better(best, strategy, request, demoted)
    if len(pool) > EXHAUSTIVE_LIMIT and (best is None or best.cost.cpu_bytes):
        best = _better(best, strategy, request, tuple(pool))  # everything streamed: the guarantee's witness
    return best


def _better(
    best: Optional[_Candidate], strategy: Strategy, request: StrategyRequest, demoted: tuple[ComponentRequest, ...]
) -> Optional[_Candidate]:
    try:
        candidate = _candidate(strategy, request, demoted)
    except PlacementError:  # this arrangement fails too
        return best
    return candidate if candidate is not None and (best is None or candidate.cost < best.cost) else best


def candidate_sets(pool: Sequence[ComponentRequest], costs: CostModel) -> Iterator[tuple[ComponentRequest, ...]]:
    """Non-empty sets to demote, smallest first; least valuable components (fewest runs, smallest) first."""
    ranked = sorted(pool, key=lambda r: (costs.runs.get(r.name, 1), r.bytes, r.position))
    for size in range(1, len(ranked) + 1):
        yield from combinations(ranked, size)


def demotion_value(request: ComponentRequest, costs: CostModel) -> int:
    """Bytes moved per call if `request` is demoted, at least: all of it homed on the host, moved at least once
    (the blocks the call never runs move nothing: `active_bytes`)."""
    return least_bytes_per_call(request.active_bytes, runs=costs.runs.get(request.name, 1))


def best_first_sets(pool: Sequence[ComponentRequest], costs: CostModel) -> Iterator[tuple[ComponentRequest, ...]]:
    """Every non-empty subset exactly once, in increasing order of the bytes their demotion moves at least.

    The classic successor scheme over items sorted by value: from a set whose last item is i, either add
    item i+1 or replace i by i+1; a heap yields the sets cheapest first.
    """
    ranked = sorted(pool, key=lambda r: (demotion_value(r, costs), r.position))
    values = [demotion_value(r, costs) for r in ranked]
    heap = [(values[0], (0,))] if ranked else []
    while heap:
        total, indices = heapq.heappop(heap)
        yield tuple(ranked[i] for i in indices)
        last = indices[-1]
        if last + 1 < len(ranked):
            heapq.heappush(heap, (total + values[last + 1], indices + (last + 1,)))
            heapq.heappush(heap, (total - values[last] + values[last + 1], indices[:-1] + (last + 1,)))


def _with_bounds(sets: Iterator, costs: CostModel) -> Iterator[tuple[tuple[ComponentRequest, ...], PlanCost]]:
    """Each set with the least cost a candidate demoting it can have: nothing on the CPU, crossings none, its
    bytes moved once."""
    for demoted in sets:
        yield demoted, PlanCost.at_least(sum(demotion_value(r, costs) for r in demoted))


def _candidate(
    strategy: Strategy, request: StrategyRequest, demoted: tuple[ComponentRequest, ...]
) -> Optional[_Candidate]:
    """The strategy over the others, then `demoted` streamed; None when one of them cannot run on an accelerator."""
    kept = [r for r in request.requests if all(r is not d for d in demoted)]
    state = strategy(request.with_requests(kept)) if kept else PlacementState.of(*request.start())
    ledger = state.ledger.copy()
    placements = Placements(by_name=dict(state.by_name))
    for component in sorted(demoted, key=lambda r: (-(r.streamed + r.transient), r.position)):
        placed = _stream(component, ledger, request.context)
        if placed is None:
            return None
        placements.add(placed)
    cost = request.cost(placements.by_name, ledger)
    state = replace(state, ledger=ledger, by_name=PlacementState.of(ledger, placements).by_name)
    return _Candidate(demoted=demoted, state=state, cost=cost)


def _stream(request: ComponentRequest, ledger: Ledger, context: Context) -> Optional[Placed]:
    """Weights in CPU RAM (or, when RAM is short, the offload folder), executed on an accelerator."""
    device = streaming_device(request, ledger, ledger.accelerators)
    if device is None:
        return None
    if ledger.fits("cpu", weights=request.bytes):
        host = "cpu"
    elif context.has_offload_folder and ledger.has("disk") and ledger.fits("disk", weights=request.bytes):
        host = "disk"
    else:
        return None
    return place_streamed(request, ledger, host=host, execution_device=device, reason="")  # reason: below


def _explain_demotions(
    best: _Candidate, base: Optional[_Candidate], failure: Optional[PlacementError]
) -> PlacementState:
    """Give every demoted component a fallback saying what it was, what ran on the CPU without it, the numbers."""
    base_plans = {} if base is None else {name: placed.plan for name, placed in base.state.by_name.items()}
    best_plans = {name: placed.plan for name, placed in best.state.by_name.items()}
    by_name = dict(best.state.by_name)
    after = _cpu_text(best_plans) or "nothing"
    if base is None:
        goal, before = "the plan fits at all", f"Without demotions planning fails ({failure})"
    else:
        goal = "no component runs on the CPU" if after == "nothing" else "less runs on the CPU"
        before = f"Without demotions these would execute on the CPU: {_cpu_text(base_plans)}"
    for request in best.demoted:
        plan = best_plans[request.name]
        what = _what(base_plans[request.name]) if base_plans else f"Demoted to streaming ({format_bytes(request.bytes)})"
        reason = (
            f"{what}, so that {goal}. {before}; on the CPU now: {after}. "
            f"{streamed_text(plan.devices[0], plan.execution_device, plan.streamed_unit_bytes)} Offloaded "
            "components on one device run one after another and share that room."
        )
        fallback = Fallback(component=request.name, kind=plan.kind, reason=reason, demoted=True)
        by_name[request.name] = Placed(plan=plan, fallback=fallback)
    return replace(best.state, by_name=MappingProxyType(by_name))


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
