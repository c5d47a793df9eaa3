"""Why a balanced map differs from the zig-zag one diffusers users know: recorded in the Plan (`map_reasons`).

One headline says what is wrong with the zig-zag map (it does not fit; it fills a device well past the best
possible; or it crosses devices on more model-graph edges), then one line per component placed elsewhere,
with the numbers: "vae on GPU 1, not GPU 0 as in the zig-zag map: its 1.50 GiB activation peak does not fit
beside transformer there (GPU 0 would peak at 25.10 GiB, budget 24.00 GiB)."
"""

from __future__ import annotations

from typing import Sequence

from ..devices import device_label
from ..sizes import format_bytes
from .assignment import TOLERANCE, Assignment, Problem, crossings, fullest_share, slot_peaks


def map_reasons(problem: Problem, chosen: Assignment, *, names: Sequence[str]) -> list[str]:
    """Nothing when the chosen map is the zig-zag map (or there is none to compare with)."""
    zigzag = problem.preferred
    if zigzag is None or tuple(chosen.slots) == tuple(zigzag):
        return []
    peaks = slot_peaks(problem, zigzag)
    over = [s for s, slot in enumerate(problem.slots) if slot.budget is not None and peaks[s] > slot.budget]
    share = fullest_share(problem, zigzag)
    limit = min(1.0, chosen.optimum * (1 + TOLERANCE))
    label = [device_label(slot.device) for slot in problem.slots]
    if over:
        s = over[0]
        headline = (
            f"The zig-zag map (diffusers') does not fit: {label[s]} would peak at {format_bytes(peaks[s])}, "
            f"over its {format_bytes(problem.slots[s].budget)} budget."
        )
    elif share > limit:
        headline = (
            f"The zig-zag map (diffusers') fills the fullest device to {share:.0%} of its budget; this map's "
            f"fullest is at {chosen.fullest:.0%} (the best whole-component map: {chosen.optimum:.0%})."
        )
    else:
        headline = (
            f"The zig-zag map (diffusers') is as full (within {TOLERANCE:.0%} of the best) but "
            f"{crossings(problem, zigzag)} model-graph edges cross devices there; here {chosen.crossings}."
        )
    lines = [headline]
    for i, (s, z) in enumerate(zip(chosen.slots, zigzag)):
        if s != z:
            lines.append(f"{names[i]} on {label[s]}, not {label[z]} as in the zig-zag map: " + _why(problem, i, z, peaks, names))
    return lines


def _why(problem: Problem, i: int, z: int, peaks: list[int], names: Sequence[str]) -> str:
    item, slot = problem.items[i], problem.slots[z]
    beside = [names[j] for j, s in enumerate(problem.preferred) if s == z and j != i]
    where = f"beside {', '.join(beside)} " if beside else ""
    if slot.budget is not None and peaks[z] > slot.budget:
        need = (
            f"its {format_bytes(item.transient)} activation peak does not fit"
            if item.transient and item.transient >= max(slot.transient, *(problem.items[j].transient for j, s in enumerate(problem.preferred) if s == z))
            else f"its {format_bytes(item.weights)} of weights do not fit"
        )
        return (
            f"{need} {where}there ({device_label(slot.device)} would peak at {format_bytes(peaks[z])}, budget "
            f"{format_bytes(slot.budget)})."
        )
    if slot.budget:
        return f"{where}there {device_label(slot.device)} would be at {peaks[z] / slot.budget:.0%} of its budget."
    return "the other components' moves leave it better placed here."
