"""The placement search: the strategy's own plan and every option that keeps components off the accelerators'
resident room (`options`), compared by `cost.PlanCost` in one branch-and-bound loop (docs/design.md, "When it
does not fit").

The strategy's own plan (balanced: the best whole-component map, else the zig-zag with the fallback chain;
sequential: execution order with the chain) is the first candidate. When it keeps everything resident on
accelerators nothing moves per call, and it is the plan: a pipeline that fits is planned exactly as the strategy
places it. Otherwise the options are visited in `options`' order:
- demotions, when the strategy's plan executes something on the CPU (or fails): the strategy places the others,
  then each demoted component streams to the accelerator with the most room for its working set, so that
  nothing runs on the CPU needlessly (a candidate in which a demoted component cannot run on an accelerator is
  dropped);
- residency levels x home (balanced only), when the strategy's plan moves bytes per call or runs something on
  the CPU: every component executes on an accelerator, the cheapest mix of WHOLE, FILL and STREAM wins.
Each option comes with the least it can cost (`cost.least_cost` of the components it keeps wholly off the
resident room); an option that cannot beat the best candidate found is never built. The cheapest candidate wins,
ties to the one visited first (the strategy's own plan, then demotions, then residency levels).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterator, Optional

from ..cost import PlanCost, least_cost
from ..errors import PlacementError
from ..memory_model import Ledger
from .fallbacks import Context, place_streamed, streaming_device
from .options import Choice, demotion_sets, priority_order, residency_choices
from .request import ComponentRequest, Placed, Placements
from .levels import Evaluated, Residency
from .search_plans import explain_demotions
from .spec import StrategyKind
from .state import PlacementState, Strategy, StrategyRequest


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One candidate plan and its cost: a built state (the strategy's own, with `demoted` streamed), or a
    residency option evaluated and built only if it wins."""

    cost: PlanCost
    state: Optional[PlacementState] = None
    demoted: tuple[ComponentRequest, ...] = ()
    evaluated: Optional[Evaluated] = None


def searched(strategy: Strategy, *, residency: bool) -> Strategy:
    """`strategy`, replaced by the cheapest option of the search when its own plan does not fit resident."""

    def place(request: StrategyRequest) -> PlacementState:
        return place_searched(strategy, request, residency=residency)

    place.__name__ = f"{getattr(strategy, '__name__', 'strategy')}_searched"
    return place


def place_searched(strategy: Strategy, request: StrategyRequest, *, residency: bool) -> PlacementState:
    """The cheapest candidate (see the module doc)."""
    try:
        base, failure = demoted(strategy, request, ()), None
    except PlacementError as error:  # e.g. a component needs the disk and no offload folder was given
        base, failure = None, error
    if base is not None and base.cost.cpu_bytes == 0 and base.cost.transfer_bytes == 0:
        return base.state  # everything resident: nothing moves per call, nothing changes
    search = _Search(strategy, request, residency=residency)
    best = base
    for bound, build in search.options(base):
        if best is not None and best.cost <= bound:
            continue  # no candidate of this option can be cheaper than the best one
        candidate = build()
        if candidate is not None and (best is None or candidate.cost < best.cost):
            best = candidate
    if best is None:
        raise failure
    if best.evaluated is not None:
        return search.residency.materialize(best.evaluated)
    if best is base:
        return base.state
    best = demoted(strategy, request, best.demoted) or best  # the winner again, with every tie-break
    return explain_demotions(best.state, best.demoted, None if base is None else base.state, failure)


class _Search:
    """The options of one request, and what building each costs."""

    def __init__(self, strategy: Strategy, request: StrategyRequest, *, residency: bool):
        self.strategy = strategy
        self.request = request
        self.quick = replace(request, thorough=False)  # the tie-break cost never changes; the winner gets it
        self.runs = request.costs.runs
        self.residency = None
        if residency and request.ledger.accelerators and request.requests:
            self.residency = Residency(request, priority_order(request.requests, self.runs),
                                       low_0=request.spec.kind is StrategyKind.BALANCED_LOW_0)

    def options(self, base: Optional[Candidate]) -> Iterator[tuple[PlanCost, Callable[[], Optional[Candidate]]]]:
        """Each option the search visits, with the least it can cost and how to build it."""
        ledger = self.request.ledger
        if (base is None or base.cost.cpu_bytes) and ledger.accelerators:
            pool = [r for r in self.request.requests if streaming_device(r, ledger, ledger.accelerators) is not None]
            for demoted_set in demotion_sets(pool, self.runs):
                yield least_cost(demoted_set, self.runs), partial(self._demotion, demoted_set)
        if self.residency is not None:
            for choice in residency_choices(self.residency.order, self.residency.homes, self.runs):
                yield least_cost(choice.streamed(self.residency.order), self.runs), partial(self._level, choice)

    def _demotion(self, demoted_set: tuple[ComponentRequest, ...]) -> Optional[Candidate]:
        try:
            return demoted(self.strategy, self.quick, demoted_set)
        except PlacementError:  # this arrangement fails too
            return None

    def _level(self, choice: Choice) -> Optional[Candidate]:
        evaluated = self.residency.evaluate(choice)
        return None if evaluated is None else Candidate(cost=evaluated.cost, evaluated=evaluated)


def demoted(strategy: Strategy, request: StrategyRequest, demoted_set: tuple[ComponentRequest, ...]
            ) -> Optional[Candidate]:
    """The strategy over the others, then `demoted_set` streamed (largest working set first); None when one of
    them cannot run on an accelerator."""
    kept = [r for r in request.requests if all(r is not d for d in demoted_set)]
    state = strategy(request.with_requests(kept)) if kept else PlacementState.of(*request.start())
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
    if device is None:
        return None
    if ledger.fits("cpu", weights=request.bytes):
        host = "cpu"
    elif context.has_offload_folder and ledger.has("disk") and ledger.fits("disk", weights=request.bytes):
        host = "disk"
    else:
        return None
    return place_streamed(request, ledger, host=host, execution_device=device, reason="")  # reason: explained
