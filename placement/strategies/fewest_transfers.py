"""Among plans that fit: nothing on the CPU if any plan avoids it, then the fewest bytes moved per call, then
the balanced objective (docs/design.md, "When it does not fit").

`with_fewest_transfers(strategy)` runs the strategy first (balanced, with its demotions). When its plan keeps
every component resident on accelerators, it moves nothing per call and is kept as it is: a pipeline that fits
is planned exactly as before. Otherwise the residency search (`residency.place_by_residency`) runs too, and the
cheaper plan by `cost.PlanCost` wins (the strategy's own, e.g. one that must execute something on the CPU,
competes with the search's, which executes everything on accelerators).
"""

from __future__ import annotations

from typing import Optional

from ..cost import PlanCost
from ..errors import PlacementError
from .residency import place_by_residency
from .spec import StrategyKind
from .state import PlacementState, Strategy, StrategyRequest


def with_fewest_transfers(strategy: Strategy) -> Strategy:
    """`strategy`, replaced by the residency search's plan when that moves fewer bytes per call."""

    def place(request: StrategyRequest) -> PlacementState:
        return place_fewest_transfers(strategy, request)

    place.__name__ = f"{getattr(strategy, '__name__', 'strategy')}_with_fewest_transfers"
    return place


def place_fewest_transfers(strategy: Strategy, request: StrategyRequest) -> PlacementState:
    try:
        base, failure = strategy(request), None
    except PlacementError as error:  # e.g. a component needs the disk and no offload folder was given
        base, failure = None, error
    base_cost = None if base is None else _cost(base, request)
    if base_cost is not None and base_cost.cpu_bytes == 0 and base_cost.transfer_bytes == 0:
        return base  # everything resident: nothing moves per call, nothing changes
    if not request.ledger.accelerators or not request.requests:
        return _kept(base, failure)
    found = place_by_residency(request, low_0=request.spec.kind is StrategyKind.BALANCED_LOW_0)
    if found is None or (base_cost is not None and not found[1] < base_cost):
        return _kept(base, failure)
    return found[0]


def _cost(state: PlacementState, request: StrategyRequest) -> PlanCost:
    return request.cost(state.by_name, state.ledger)


def _kept(base: Optional[PlacementState], failure: Optional[PlacementError]) -> PlacementState:
    if base is None:
        raise failure
    return base
