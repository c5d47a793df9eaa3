"""No accelerator to plan for: every component runs on the CPU (weights on disk when RAM is short)."""

from __future__ import annotations

from typing import Sequence

from ..memory_model import Ledger
from ..sizes import format_bytes
from .fallbacks import Context, place_on_host, place_whole
from .request import ComponentRequest, Placements


def place_cpu_only(
    requests: Sequence[ComponentRequest], ledger: Ledger, context: Context, placements: Placements
) -> None:
    for request in sorted(requests, key=lambda request: request.position):
        if ledger.fits("cpu", weights=request.bytes, transient=request.transient):
            placements.add(place_whole(request, ledger, "cpu"))
        else:
            room = max(ledger.room("cpu", transient=request.transient) or 0, 0)
            why = f"{request.needs()}; the CPU has {format_bytes(room)} left."
            placements.add(place_on_host(request, ledger, context, why))
