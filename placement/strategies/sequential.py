""""sequential": fill accelerator 0, then 1, ... with the components in execution order.

A component goes whole onto the current accelerator or a later one (which then becomes current), so
consecutive components share a device and the pipeline crosses devices as rarely as possible. Only when no
later accelerator has room are the earlier ones tried, before the fallback chain: a component is kept whole
whenever some accelerator has room for it.
"""

from __future__ import annotations

from .fallbacks import place_with_fallbacks
from .state import PlacementState, StrategyRequest


def place_sequential(request: StrategyRequest) -> PlacementState:
    ledger, placements = request.start()
    accelerators = ledger.accelerators
    current = 0
    for component in sorted(request.requests, key=lambda component: component.position):
        order = accelerators[current:] + accelerators[:current]
        placed = place_with_fallbacks(component, ledger, request.context, whole_order=order, split_order=order)
        placements.add(placed)
        used = [accelerators.index(d) for d in placed.plan.devices if d in accelerators]
        current = max([current, *used])
    return PlacementState.of(ledger, placements)
