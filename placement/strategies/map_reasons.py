"""Why a balanced map differs from the zig-zag one diffusers users know: recorded in the Plan (`map_reasons`).

One headline says what is wrong with the zig-zag map (it does not fit; it fills a device well past the best
possible; or it crosses devices on more model-graph edges), then one line per component placed elsewhere,
with the numbers: "vae on GPU 1, not GPU 0 as in the zig-zag map: its 1.50 GiB activation peak does not fit
beside transformer there (GPU 0 would peak at 25.10 GiB, budget 24.00 GiB)."

`left_empty` says, per accelerator the map leaves empty, why (`Plan.left_empty`; the picture shows it on that
GPU's bar): a newcomer planning two GPUs and seeing one empty should not have to guess that balanced kept the
pipeline together for fewer crossing edges and one runtime overhead instead of two.
"""

from __future__ import annotations

from typing import Sequence

from ..devices import device_label
from ..sizes import format_bytes
from .assignment import TOLERANCE, Assignment, Problem, crossings, fullest_share, slot_peaks


def left_empty(problem: Problem, chosen: Assignment) -> dict:
    """{device: why it holds nothing} for the accelerators the chosen map leaves empty (held nothing before)."""
    used = sorted(set(chosen.slots))
    zigzag = problem.preferred
    reasons = {}
    for s, slot in enumerate(problem.slots):
        if s in used or slot.used or slot.weights:
            continue
        label = device_label(slot.device)
        if zigzag is None or s not in zigzag:
            if len(problem.items) < len(problem.slots):
                reasons[slot.device] = (f"{label} is left empty: each of the {len(problem.items)} component(s) is "
                                        f"placed whole, and there are {len(problem.slots)} GPUs.")
            continue
        kept = " and ".join(device_label(problem.slots[u].device) for u in used)
        share = fullest_share(problem, zigzag)
        text = (f"{label} is left empty: this map keeps every component on {kept}, whose peak is "
                f"{chosen.fullest:.1%} of its budget; the zig-zag map, which uses {label} too, peaks at {share:.1%}")
        text += f" (not emptier by {TOLERANCE:.0%} or more)" if share * (1 + TOLERANCE) >= chosen.fullest else ""
        text += f", with {crossings(problem, zigzag)} model-graph edges crossing devices (here {chosen.crossings})"
        if slot.overhead:
            text += (f" and {len(set(zigzag))} runtime overheads instead of {len(used)} ({format_bytes(slot.overhead)}"
                     " each: every GPU in use keeps one)")
        reasons[slot.device] = text + "."
    return reasons


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
            lines.append(f"{names[i]} on {label[s]}, not {label[z]} as in the zig-zag map: " + _why(problem, i, z, peaks, names, limit))
    return lines


def _why(problem: Problem, i: int, z: int, peaks: list[int], names: Sequence[str], limit: float) -> str:
    """Why component i is not on its zig-zag slot z (peaks: each slot's peak under the zig-zag map)."""
    item, slot = problem.items[i], problem.slots[z]
    others = [j for j, s in enumerate(problem.preferred) if s == z and j != i]
    where = f"beside {', '.join(names[j] for j in others)} " if others else ""
    rest = max([slot.transient, *(problem.items[j].transient for j in others)])
    extra_transient = max(item.transient - rest, 0)  # what its activations add on top of the others'
    if slot.budget is not None and peaks[z] > slot.budget and peaks[z] - item.weights - extra_transient <= slot.budget:
        # Without it the device would fit: it is the one that does not fit there.
        if extra_transient and peaks[z] - extra_transient <= slot.budget:
            need = f"its {format_bytes(item.transient)} activation peak does not fit"
        else:
            need = f"its {format_bytes(item.weights)} of weights do not fit"
        return (
            f"{need} {where}there ({device_label(slot.device)} would peak at {format_bytes(peaks[z])}, budget "
            f"{format_bytes(slot.budget)})."
        )
    if slot.budget and peaks[z] > slot.budget * limit:
        return (
            f"{where}there {device_label(slot.device)} would be at {peaks[z] / slot.budget:.0%} of its budget, "
            f"past the {limit:.0%} this map stays within."
        )
    return (
        "moved with the others: of the maps within "
        f"{TOLERANCE:.0%} of the best, this one crosses devices on the fewest model-graph edges."
    )
