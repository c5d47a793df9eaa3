""""balanced" (and "auto", and "balanced_low_0"): components whole, largest first, accelerators in zig-zag.

The i-th component (largest first, ties in execution order) has its turn on the i-th accelerator of the
zig-zag 0, 1, ..., n-1, n-1, ..., 0. When that accelerator has no room, the others are tried, the one with
the most room first, before any fallback: diffusers sends the component to the CPU instead, even when
another GPU has room.

Largest-first can fragment the room: a splittable component placed whole early can leave no single GPU
with room for a later one that has no blocks to cut. When the largest-first plan leaves weights off the
accelerators, the components are placed again least divisible first (largest split unit first), so the
splittable ones fill what is left; the plan with fewer bytes off the accelerators wins (ties: largest
first). The order used is recorded in `Plan.placement_order`.

"balanced_low_0" keeps accelerator 0 as empty as possible: the zig-zag runs over the others, and 0 is
tried last, before falling back (it is chosen by key, not by position as accelerate does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import PlacementError
from ..memory_model import Ledger
from .cost import host_bytes
from .fallbacks import Context, place_with_fallbacks
from .request import ComponentRequest, Placements


@dataclass(frozen=True, kw_only=True)
class _Attempt:
    ledger: Ledger
    placements: Placements
    off_accelerators: int


def place_balanced(
    requests: Sequence[ComponentRequest],
    ledger: Ledger,
    context: Context,
    placements: Placements,
    *,
    low_0: bool = False,
) -> None:
    best: Optional[_Attempt] = None
    first_error: Optional[PlacementError] = None
    for order in (largest_first(requests), least_divisible_first(requests)):
        try:
            attempt = _attempt(order, ledger, context, placements, low_0=low_0)
        except PlacementError as error:  # e.g. needs the disk without an offload folder
            first_error = first_error or error
            continue
        if best is None or attempt.off_accelerators < best.off_accelerators:
            best = attempt
        if best.off_accelerators == 0:
            break
    if best is None:
        raise first_error
    ledger.loads = best.ledger.loads
    placements.by_name = best.placements.by_name


def _attempt(order, ledger: Ledger, context: Context, placements: Placements, *, low_0: bool) -> _Attempt:
    trial_ledger = ledger.copy()
    trial = Placements(by_name=dict(placements.by_name))
    accelerators = trial_ledger.accelerators
    reserved = [0] if low_0 and 0 in accelerators and len(accelerators) > 1 else []
    turns = [device for device in accelerators if device not in reserved]
    zigzag = turns + turns[::-1]
    for index, request in enumerate(order):
        turn = zigzag[index % len(zigzag)]
        others = sorted(
            (d for d in turns if d != turn),
            key=lambda d: (-trial_ledger.room(d, transient=request.transient), d),
        )
        device_order = [turn, *others, *reserved]
        placed = place_with_fallbacks(
            request, trial_ledger, context, whole_order=device_order, split_order=device_order
        )
        trial.add(placed)
    off = sum(host_bytes(trial.by_name[request.name].plan) for request in order)
    return _Attempt(ledger=trial_ledger, placements=trial, off_accelerators=off)


def largest_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.bytes, request.position))


def least_divisible_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.size.largest_unit, -request.bytes, request.position))
