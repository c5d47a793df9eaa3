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
dropped. The cheapest candidate (`cost.PlanCost`: bytes executing on the CPU, then whether the component that
runs most is streamed, then bytes streamed per call, then crossing edges) is kept; ties go to the earliest.

D ranges over the subsets of the components that could stream at all (some accelerator can hold their working
set), smallest subsets first, and within a size the least valuable components first (fewest runs per call,
then smallest). Up to EXHAUSTIVE_LIMIT such components every subset is tried; past it, the nested prefixes of
that order (one, two, ... all of them), so the search stays linear. Both include "all of them", which puts
everything on an accelerator whenever one can hold the largest working set: the guarantee the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Iterator, Optional, Sequence

from ..devices import device_label
from ..errors import PlacementError
from ..memory_model import Ledger
from ..plan import ComponentPlan, Fallback, PlacementKind
from ..sizes import format_bytes
from .cost import CostModel, PlanCost
from .fallbacks import Context, place_streamed, streamed_text, streaming_device
from .request import ComponentRequest, Placed, Placements

EXHAUSTIVE_LIMIT = 8  # 2**8 - 1 = 255 extra strategy runs at most (a run is milliseconds: splits are cached)

Strategy = Callable[[Sequence[ComponentRequest], Ledger, Context, Placements], None]


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    demoted: tuple[ComponentRequest, ...]
    ledger: Ledger
    placements: Placements
    cost: PlanCost


def place_with_demotions(
    strategy: Strategy,
    requests: Sequence[ComponentRequest],
    ledger: Ledger,
    context: Context,
    placements: Placements,
    costs: CostModel,
) -> None:
    """Run `strategy`; if it executes something on the CPU (or fails), keep the cheapest plan with demotions."""
    try:
        base, failure = _candidate(strategy, requests, (), ledger, context, placements, costs), None
    except PlacementError as error:  # e.g. no device can run a component whose weights must go to disk
        base, failure = None, error
    best = base
    if (base is None or base.cost.cpu_bytes) and ledger.accelerators:
        pool = [request for request in requests if streaming_device(request, ledger, ledger.accelerators) is not None]
        for demoted in candidate_sets(pool, costs):
            try:
                candidate = _candidate(strategy, requests, demoted, ledger, context, placements, costs)
            except PlacementError:  # this arrangement fails too
                continue
            if candidate is not None and (best is None or candidate.cost < best.cost):
                best = candidate
    if best is None:
        raise failure
    if best is not base:
        _explain_demotions(best, base, failure)
    ledger.loads = best.ledger.loads
    placements.by_name = best.placements.by_name


def candidate_sets(pool: Sequence[ComponentRequest], costs: CostModel) -> Iterator[tuple[ComponentRequest, ...]]:
    """Non-empty sets to demote, smallest first; least valuable components (fewest runs, smallest) first."""
    ranked = sorted(pool, key=lambda r: (costs.runs.get(r.name, 1), r.bytes, r.position))
    if len(ranked) <= EXHAUSTIVE_LIMIT:
        for size in range(1, len(ranked) + 1):
            yield from combinations(ranked, size)
    else:
        for size in range(1, len(ranked) + 1):
            yield tuple(ranked[:size])


def _candidate(
    strategy: Strategy,
    requests: Sequence[ComponentRequest],
    demoted: tuple[ComponentRequest, ...],
    ledger: Ledger,
    context: Context,
    placements: Placements,
    costs: CostModel,
) -> Optional[_Candidate]:
    """The strategy over the others, then `demoted` streamed; None when one of them cannot run on an accelerator."""
    trial_ledger = ledger.copy()
    trial = Placements(by_name=dict(placements.by_name))
    kept = [request for request in requests if all(request is not d for d in demoted)]
    if kept:
        strategy(kept, trial_ledger, context, trial)
    for request in sorted(demoted, key=lambda r: (-(r.streamed + r.transient), r.position)):
        placed = _stream(request, trial_ledger, context)
        if placed is None:
            return None
        trial.add(placed)
    cost = costs.cost(trial.by_name, {request.name for request in requests})
    return _Candidate(demoted=demoted, ledger=trial_ledger, placements=trial, cost=cost)


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


def _explain_demotions(best: _Candidate, base: Optional[_Candidate], failure: Optional[PlacementError]) -> None:
    """Give every demoted component a fallback saying what it was, what ran on the CPU without it, the numbers."""
    base_plans = {} if base is None else {name: placed.plan for name, placed in base.placements.by_name.items()}
    best_plans = {name: placed.plan for name, placed in best.placements.by_name.items()}
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
        best.placements.by_name[request.name] = Placed(plan=plan, fallback=fallback)


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
