""""balanced" (and "auto", and "balanced_low_0"): components whole, the fullest device as empty as possible.

When every component can be placed whole, `optimal` finds the whole-component map whose fullest accelerator
(predicted peak, with activations and runtime overhead, as a share of its budget) is within 5% of the best
possible, preferring the fewest model-graph edges crossing devices, then diffusers' zig-zag map (largest first
over 0, 1, ..., n-1, n-1, ..., 0). Where the map differs from the zig-zag, the plan says why (`map_reasons`).

When no whole map fits, the components are placed one by one in the zig-zag with the fallback chain (split,
offload, cpu, disk): the i-th component (largest first, ties in execution order) has its turn on the i-th
accelerator of the zig-zag; when that accelerator has no room, the others are tried, the one with the most room
first, before any fallback (diffusers sends the component to the CPU instead, even when another GPU has room).
Largest-first can fragment the room: a splittable component placed whole early can leave no single GPU with
room for a later one that has no blocks to cut. So the components are also placed least divisible first
(largest split unit first), so the splittable ones fill what is left; the plan with fewer bytes off the
accelerators wins (ties: largest first). The order used is recorded in `Plan.placement_order`.

"balanced_low_0" keeps accelerator 0 as empty as possible: the weights it takes are minimised first (the
zig-zag runs over the others), and in the fallback path 0 is tried last (chosen by key, not by position as
accelerate does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..cost import host_bytes
from ..errors import PlacementError
from .fallbacks import place_with_fallbacks
from .optimal import largest_first, place_whole_optimally
from .request import ComponentRequest
from .spec import StrategyKind
from .state import PlacementState, StrategyRequest


@dataclass(frozen=True, kw_only=True)
class _Attempt:
    state: PlacementState
    off_accelerators: int


def place_balanced(request: StrategyRequest) -> PlacementState:
    low_0 = request.spec.kind is StrategyKind.BALANCED_LOW_0
    optimal = place_whole_optimally(request, low_0=low_0)
    if optimal is not None:
        return optimal
    return place_zigzag_with_fallbacks(request, low_0=low_0)


def place_zigzag_with_fallbacks(request: StrategyRequest, *, low_0: bool) -> PlacementState:
    """The zig-zag, largest first and least divisible first, with the fallback chain; the better of the two."""
    best: Optional[_Attempt] = None
    first_error: Optional[PlacementError] = None
    for order in (largest_first(request.requests), least_divisible_first(request.requests)):
        try:
            attempt = _attempt(order, request, low_0=low_0)
        except PlacementError as error:  # e.g. needs the disk without an offload folder
            first_error = first_error or error
            continue
        if best is None or attempt.off_accelerators < best.off_accelerators:
            best = attempt
        if best.off_accelerators == 0:
            break
    if best is None:
        raise first_error
    return best.state


def _attempt(order: Sequence[ComponentRequest], request: StrategyRequest, *, low_0: bool) -> _Attempt:
    ledger, placements = request.start()
    accelerators = ledger.accelerators
    reserved = [0] if low_0 and 0 in accelerators and len(accelerators) > 1 else []
    turns = [device for device in accelerators if device not in reserved]
    zigzag = turns + turns[::-1]
    for index, component in enumerate(order):
        turn = zigzag[index % len(zigzag)]
        others = sorted(
            (d for d in turns if d != turn),
            key=lambda d: (-ledger.room(d, transient=component.transient), d),
        )
        device_order = [turn, *others, *reserved]
        placed = place_with_fallbacks(
            component, ledger, request.context, whole_order=device_order, split_order=device_order
        )
        placements.add(placed)
    off = sum(host_bytes(placements.by_name[component.name].plan) for component in order)
    return _Attempt(state=PlacementState.of(ledger, placements), off_accelerators=off)


def least_divisible_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.size.largest_unit, -request.bytes, request.position))
