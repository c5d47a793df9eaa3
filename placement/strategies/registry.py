"""The one table from strategy kind to strategy, and the dispatch `placement.plan` runs.

A strategy is any callable `StrategyRequest -> PlacementState` (see `state`). Registering one is one line:

    STRATEGIES[StrategyKind.SOMETHING] = searched(place_something, residency=False)

`searched` runs a strategy that chooses accelerators itself as the first candidate of the placement search
(`search`): demoting components to streaming competes with it, so that nothing runs needlessly on the CPU, and
for the balanced family (`residency=True`) so do the residency levels, so that a pipeline that does not fit
resident moves the fewest bytes per call. "sequential" keeps its meaning (fill in execution order); every
strategy's plan gets its transfer numbers in `placement.plan`.
With no accelerator to plan for, every strategy but a single device degrades to `place_cpu_only`. A
model-level request (`StrategySpec.model_level`) is looked up in `MODEL_STRATEGIES` instead.
"""

from __future__ import annotations

from .balanced import place_balanced
from .cpu_only import place_cpu_only
from .model_level import place_model_level
from .search import searched
from .sequential import place_sequential
from .single_device import place_single_device
from .spec import StrategyKind
from .state import PlacementState, Strategy, StrategyRequest

_BALANCED = searched(place_balanced, residency=True)
STRATEGIES: dict[StrategyKind, Strategy] = {
    StrategyKind.BALANCED: _BALANCED,
    StrategyKind.AUTO: _BALANCED,  # the same as balanced (documented, not an error)
    StrategyKind.BALANCED_LOW_0: _BALANCED,  # place_balanced and the residency search read the kind
    StrategyKind.DICT: _BALANCED,  # the components the dict does not pin
    StrategyKind.SEQUENTIAL: searched(place_sequential, residency=False),
    StrategyKind.DEVICE: place_single_device,
}
# One model (`scope="model"`): the same names with accelerate's model-level meaning (`model_level`).
MODEL_STRATEGIES: dict[StrategyKind, Strategy] = {
    kind: place_model_level for kind in StrategyKind if kind is not StrategyKind.DEVICE
}


def place_free_components(request: StrategyRequest) -> PlacementState:
    """Place the components nobody pinned, by the request's strategy; returns the state it built."""
    if request.spec.model_level:  # accelerate's fill order (accelerators, CPU, disk) covers "no accelerator"
        return MODEL_STRATEGIES[request.spec.kind](request)
    if request.spec.kind is not StrategyKind.DEVICE and not request.ledger.accelerators:
        return place_cpu_only(request)
    return STRATEGIES[request.spec.kind](request)
