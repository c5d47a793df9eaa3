"""Placement strategies (DESIGN.md, "Strategies"): one small module each, sharing the fallback chain."""

from __future__ import annotations

from functools import partial
from typing import Sequence

from ..memory_model import Ledger
from .balanced import place_balanced
from .cost import CostModel, PlanCost
from .cpu_only import place_cpu_only
from .demotion import place_with_demotions
from .fallbacks import Context
from .model_level import budgets_of, charge, place_model
from .request import ComponentRequest, Placed, Placements
from .sequential import place_sequential
from .single_device import place_single_device
from .spec import SUPPORTED, StrategyKind, StrategyScope, StrategySpec, parse_strategy

__all__ = [
    "SUPPORTED",
    "ComponentRequest",
    "Context",
    "CostModel",
    "Placed",
    "Placements",
    "PlanCost",
    "StrategyKind",
    "StrategyScope",
    "StrategySpec",
    "parse_strategy",
    "place_free_components",
]


def place_free_components(
    spec: StrategySpec,
    requests: Sequence[ComponentRequest],
    ledger: Ledger,
    context: Context,
    placements: Placements,
    notes: list[str],
    costs: CostModel,
) -> None:
    """Place the components nobody pinned, by `spec` (a dict strategy's remainder goes "balanced").

    With accelerators, the strategy's plan is kept unless demoting components to "offloaded" executes
    fewer bytes on the CPU (`demotion`). A single-device strategy places exactly where it was told.
    """
    if spec.model_level:  # one model, accelerate's meaning of the strategy names (`model_level`)
        for request in requests:
            placed = place_model(spec, request, budgets_of(ledger), disk_allowed=context.has_offload_folder)
            placements.add(charge(ledger, placed, request))
    elif spec.kind is StrategyKind.DEVICE:
        place_single_device(requests, ledger, placements, spec.device, notes)
    elif not ledger.accelerators:
        place_cpu_only(requests, ledger, context, placements)
    elif spec.kind is StrategyKind.SEQUENTIAL:
        place_with_demotions(place_sequential, requests, ledger, context, placements, costs)
    else:
        low_0 = spec.kind is StrategyKind.BALANCED_LOW_0
        strategy = partial(place_balanced, low_0=low_0)
        place_with_demotions(strategy, requests, ledger, context, placements, costs)
