"""The one table from strategy kind to strategy (`STRATEGIES`, `MODEL_STRATEGIES`), the dispatch `placement.plan`
runs, and the strategies that are one loop each: "sequential", a single device, CPU-only. A strategy that chooses
accelerators runs inside the placement search (`searched`), the balanced family with the residency levels.
"""

from __future__ import annotations

from ..devices import device_label
from ..errors import PlanError
from ..sizes import format_bytes
from .balanced import place_balanced
from .fallbacks import place_with_fallbacks, place_whole, place_on_host
from .model_level import place_model_level
from .pinned import enforce
from .search import searched
from .state import PlacementState, Strategy, StrategyKind, StrategyRequest


def place_sequential(request: StrategyRequest) -> PlacementState:
    """Accelerator 0, then 1, ... in execution order, whole on the current one or a later one, so the pipeline
    crosses devices as rarely as possible; earlier ones are tried before the fallback chain."""
    ledger, placements = request.start()
    accelerators = ledger.accelerators
    current = 0
    for component in sorted(request.requests, key=lambda component: component.position):
        order = accelerators[current:] + accelerators[:current]
        placed = place_with_fallbacks(component, ledger, request.context, order)
        placements.add(placed)
        used = [accelerators.index(d) for d in placed.plan.devices if d in accelerators]
        current = max([current, *used])
    return PlacementState.of(ledger, placements)


def place_single_device(request: StrategyRequest) -> PlacementState:
    """Everything on the spec's device: over an explicit budget is an error, over a detected one a warning."""
    device = request.spec.device
    if not request.ledger.has(device):
        raise PlanError(
            f"Strategy {device_label(device)} names a device without a budget; the devices are "
            f"{list(request.ledger.loads)}. Add {device!r} to max_memory or pick one of those."
        )
    ledger, placements = request.start()
    for component in request.requests:
        placements.add(place_whole(component, ledger, device))
    notes: list[str] = []
    enforce(ledger, [device], what=f"Putting every component on {device_label(device)}", notes=notes)
    return PlacementState.of(ledger, placements, warnings=tuple(notes))


def place_cpu_only(request: StrategyRequest) -> PlacementState:
    ledger, placements = request.start()
    for component in sorted(request.requests, key=lambda component: component.position):
        if ledger.fits("cpu", weights=component.bytes, transient=component.transient):
            placements.add(place_whole(component, ledger, "cpu"))
        else:
            room = max(ledger.room("cpu", transient=component.transient) or 0, 0)
            why = f"{component.needs()}; the CPU has {format_bytes(room)} left."
            placements.add(place_on_host(component, ledger, request.context, why))
    return PlacementState.of(ledger, placements)


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
