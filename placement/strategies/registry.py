"""The one table from strategy kind to strategy, and the dispatch `placement.plan` runs.

A strategy is any callable `StrategyRequest -> PlacementState` (see `state`). Registering one is one line:

    STRATEGIES[StrategyKind.SOMETHING] = with_demotions(place_something)

`with_demotions` wraps strategies that choose accelerators themselves, so that they never leave a component
needlessly on the CPU (`demotion`). With no accelerator to plan for, every strategy but a single device
degrades to `place_cpu_only`.
"""

from __future__ import annotations

from .balanced import place_balanced
from .cpu_only import place_cpu_only
from .demotion import with_demotions
from .sequential import place_sequential
from .single_device import place_single_device
from .spec import StrategyKind
from .state import PlacementState, Strategy, StrategyRequest

STRATEGIES: dict[StrategyKind, Strategy] = {
    StrategyKind.BALANCED: with_demotions(place_balanced),
    StrategyKind.AUTO: with_demotions(place_balanced),  # the same as balanced (documented, not an error)
    StrategyKind.BALANCED_LOW_0: with_demotions(place_balanced),  # place_balanced reads the kind
    StrategyKind.DICT: with_demotions(place_balanced),  # the components the dict does not pin
    StrategyKind.SEQUENTIAL: with_demotions(place_sequential),
    StrategyKind.DEVICE: place_single_device,
}


def place_free_components(request: StrategyRequest) -> PlacementState:
    """Place the components nobody pinned, by the request's strategy; returns the state it built."""
    if request.spec.kind is not StrategyKind.DEVICE and not request.ledger.accelerators:
        return place_cpu_only(request)
    return STRATEGIES[request.spec.kind](request)
