""""balanced" (and "auto", and "balanced_low_0"): components whole, largest first, accelerators in zig-zag.

The i-th component (largest first, ties in execution order) has its turn on the i-th accelerator of the
zig-zag 0, 1, ..., n-1, n-1, ..., 0. When that accelerator has no room, the others are tried, the one with
the most room first, before any fallback: diffusers sends the component to the CPU instead, even when
another GPU has room.

"balanced_low_0" keeps accelerator 0 as empty as possible: the zig-zag runs over the others, and 0 is
tried last, before falling back (it is chosen by key, not by position as accelerate does).
"""

from __future__ import annotations

from typing import Sequence

from ..memory_model import Ledger
from .fallbacks import Context, place_with_fallbacks
from .request import ComponentRequest, Placements


def place_balanced(
    requests: Sequence[ComponentRequest],
    ledger: Ledger,
    context: Context,
    placements: Placements,
    *,
    low_0: bool = False,
) -> None:
    accelerators = ledger.accelerators
    reserved = [0] if low_0 and 0 in accelerators and len(accelerators) > 1 else []
    turns = [device for device in accelerators if device not in reserved]
    zigzag = turns + turns[::-1]
    for index, request in enumerate(largest_first(requests)):
        turn = zigzag[index % len(zigzag)]
        others = sorted(
            (d for d in turns if d != turn),
            key=lambda d: (-ledger.room(d, transient=request.transient), d),
        )
        order = [turn, *others, *reserved]
        placements.add(place_with_fallbacks(request, ledger, context, whole_order=order, split_order=order))


def largest_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.bytes, request.position))
