"""Placement strategies (docs/design.md, "Strategies"), looked up in `registry.STRATEGIES`."""

from __future__ import annotations

from ..cost import CostModel, PlanCost
from .state import (SUPPORTED, ComponentRequest, Context, Placed, PlacementState, Placements, Strategy, StrategyKind,
                    StrategyRequest, StrategyScope, StrategySpec, parse_strategy)
from .registry import MODEL_STRATEGIES, STRATEGIES, place_free_components

__all__ = [
    "MODEL_STRATEGIES", "STRATEGIES", "SUPPORTED", "ComponentRequest", "Context", "CostModel", "Placed", "Placements",
    "PlacementState", "PlanCost", "Strategy", "StrategyKind", "StrategyRequest", "StrategyScope", "StrategySpec",
    "parse_strategy", "place_free_components",
]
