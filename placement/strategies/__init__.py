"""Placement strategies (DESIGN.md, "Strategies"): one small module each, looked up in `registry.STRATEGIES`."""

from __future__ import annotations

from .cost import CostModel, PlanCost
from .fallbacks import Context
from .registry import STRATEGIES, place_free_components
from .request import ComponentRequest, Placed, Placements
from .spec import SUPPORTED, StrategyKind, StrategySpec, parse_strategy
from .state import PlacementState, Strategy, StrategyRequest

__all__ = [
    "STRATEGIES",
    "SUPPORTED",
    "ComponentRequest",
    "Context",
    "CostModel",
    "Placed",
    "Placements",
    "PlacementState",
    "PlanCost",
    "Strategy",
    "StrategyKind",
    "StrategyRequest",
    "StrategySpec",
    "parse_strategy",
    "place_free_components",
]
