"""A single device ("cuda", "cuda:1", 0, "cpu", a torch.device): every component whole there, no hooks."""

from __future__ import annotations

from ..devices import device_label
from ..errors import PlanError
from .fallbacks import place_whole
from .pinned import enforce
from .state import PlacementState, StrategyRequest


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
