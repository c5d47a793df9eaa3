"""A single device ("cuda", "cuda:1", 0, "cpu", a torch.device): every component whole there, no hooks."""

from __future__ import annotations

from typing import Sequence

from ..devices import Device, device_label
from ..memory_model import Ledger
from ..planning_errors import StrategyError
from .fallbacks import place_whole
from .pinned import enforce
from .request import ComponentRequest, Placements


def place_single_device(
    requests: Sequence[ComponentRequest],
    ledger: Ledger,
    placements: Placements,
    device: Device,
    notes: list[str],
) -> None:
    """Everything on `device`: over an explicit budget is an error, over a detected one a warning."""
    if not ledger.has(device):
        raise StrategyError(
            f"Strategy {device_label(device)} names a device without a budget; the devices are "
            f"{list(ledger.loads)}. Add {device!r} to max_memory or pick one of those."
        )
    for request in requests:
        placements.add(place_whole(request, ledger, device))
    enforce(ledger, [device], what=f"Putting every component on {device_label(device)}", notes=notes)
