"""What a strategy is given (an immutable request) and what it gives back (the state it built).

A strategy never changes what it is passed: it copies the starting ledger, places its components into the
copy and returns it with the placements. Searches (the placement search, balanced's two orders) compare the
states their trials return and keep one; nothing is written back into a caller's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from ..devices import Device
from ..cost import CostModel, PlanCost
from ..memory_model import Ledger
from ..transfers.residency import component_transfers
from .fallbacks import Context
from .request import ComponentRequest, Placed, Placements
from .spec import StrategySpec


@dataclass(frozen=True, kw_only=True)
class StrategyRequest:
    """The components a strategy places, the state it starts from, and the planning options.

    `ledger` and `placed` are a snapshot: a strategy copies them (`start()`) before placing anything.
    """

    spec: StrategySpec
    requests: tuple[ComponentRequest, ...]
    ledger: Ledger
    placed: Mapping[str, Placed]  # components placed before this strategy runs (pinned ones)
    context: Context
    costs: CostModel
    # False: skip the last tie-break (fewest moves from the zig-zag map). The placement search compares many
    # candidates by cost, which that tie-break never changes; it re-runs the winner with it.
    thorough: bool = True

    @classmethod
    def build(cls, *, spec, requests: Sequence[ComponentRequest], ledger: Ledger, placed, context, costs):
        return cls(
            spec=spec, requests=tuple(requests), ledger=ledger.copy(), placed=MappingProxyType(dict(placed)),
            context=context, costs=costs,
        )

    def with_requests(self, requests: Sequence[ComponentRequest]) -> "StrategyRequest":
        return replace(self, requests=tuple(requests))

    def start(self) -> tuple[Ledger, Placements]:
        """A private copy of the starting state to place into."""
        return self.ledger.copy(), Placements(by_name=dict(self.placed))

    def cost(self, by_name: Mapping[str, Placed], ledger: Ledger) -> PlanCost:
        """What the placements `by_name` (every component, the starting ones included) cost under `ledger`,
        counting the components this request places."""
        ours = {r.name: r for r in self.requests}
        transfers = component_transfers(by_name, ours, ledger, self.costs.runs)
        return self.costs.cost({name: placed.plan for name, placed in by_name.items()}, transfers, ledger)


@dataclass(frozen=True, kw_only=True)
class PlacementState:
    """What a strategy built: the ledger after placing, every placement (the starting ones included), the
    warnings it raised, why the map differs from the familiar zig-zag (`Plan.map_reasons`) and why an accelerator
    holds nothing (`Plan.left_empty`)."""

    ledger: Ledger
    by_name: Mapping[str, Placed]
    warnings: tuple[str, ...] = ()
    map_reasons: tuple[str, ...] = field(default=())
    left_empty: Mapping[Device, str] = field(default_factory=dict)

    @classmethod
    def of(cls, ledger: Ledger, placements: Placements, **notes) -> "PlacementState":
        return cls(ledger=ledger, by_name=MappingProxyType(dict(placements.by_name)), **notes)


Strategy = Callable[[StrategyRequest], PlacementState]
