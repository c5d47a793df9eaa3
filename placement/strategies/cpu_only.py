"""No accelerator to plan for: every component runs on the CPU (weights on disk when RAM is short)."""

from __future__ import annotations

from ..sizes import format_bytes
from .fallbacks import place_on_host, place_whole
from .state import PlacementState, StrategyRequest


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
