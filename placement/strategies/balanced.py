""""balanced" (and "auto", "balanced_low_0"): components whole, the fullest accelerator as empty as possible.

The best whole-component map (`assignment`) when one fits, relabelled so the lowest interchangeable devices are
used first, with why it differs from diffusers' zig-zag map (`map_reasons`) and why a GPU is left empty
(`left_empty`); else the zig-zag with the fallback chain, largest first and least divisible first (largest-first
can fragment the room a later unsplittable component needs), the one with fewer bytes off the accelerators winning.
diffusers sends a component to the CPU when its zig-zag turn is full; here the other GPUs are tried first.
"balanced_low_0" minimises accelerator 0's weights first and tries it last (by key, not by position).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from ..cost import host_bytes
from ..devices import Device, device_label
from ..errors import PlacementError
from ..sizes import format_bytes
from .assignment import (Assignment, Item, Problem, Slot, TOLERANCE, away_from_preferred, best_assignment, crossings,
                         fullest_share, slot_peaks, symmetry_classes)
from .fallbacks import place_whole, place_with_fallbacks
from .state import ComponentRequest, PlacementState, StrategyKind, StrategyRequest


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


def place_whole_optimally(request: StrategyRequest, *, low_0: bool) -> Optional[PlacementState]:
    """Every component whole where the fullest device is within 5% of the best; None when that cannot fit."""
    problem, order = build_search(request, low_0=low_0)
    found = best_assignment(problem, prefer=request.thorough)
    if found is None:
        return None
    found = fill_from_first(problem, found)
    ledger, placements = request.start()
    for index, component in enumerate(order):
        placements.add(place_whole(component, ledger, problem.slots[found.slots[index]].device))
    reasons = map_reasons(problem, found, names=[c.name for c in order])
    return PlacementState.of(ledger, placements, map_reasons=tuple(reasons), left_empty=left_empty(problem, found))


def fill_from_first(problem: Problem, found: Assignment) -> Assignment:
    """The same map with interchangeable devices relabelled so the lower ones are used first: at equal cost a
    small pipeline goes to GPU 0, not to GPU 1 beside an empty GPU 0. Only the moves from the zig-zag change."""
    classes: dict[tuple, list[int]] = {}
    for index, key in enumerate(symmetry_classes(problem.slots)):
        classes.setdefault(key, []).append(index)
    relabel: dict[int, int] = {}
    for members in classes.values():
        used = [s for s in members if s in found.slots]
        relabel.update(zip(used, members[: len(used)]))
    slots = tuple(relabel.get(s, s) for s in found.slots)
    if slots == found.slots:
        return found
    return replace(found, slots=slots, moved=away_from_preferred(problem, slots))


def reserved_zero(accelerators: Sequence[Device], low_0: bool) -> tuple[Device, ...]:
    """(0,) when "balanced_low_0" keeps accelerator 0 as empty as it can (it has another to use), else ()."""
    return (0,) if low_0 and 0 in accelerators and len(accelerators) > 1 else ()


def build_search(request: StrategyRequest, *, low_0: bool) -> tuple[Problem, tuple[ComponentRequest, ...]]:
    """The whole-map problem of a request, and its components largest first (the zig-zag's order)."""
    ledger = request.ledger
    accelerators = ledger.accelerators
    reserved = reserved_zero(accelerators, low_0)
    slots = tuple(Slot(device=device, budget=load.budget, weights=load.weights, transient=load.transient,
                       used=load.used, overhead=ledger.overhead(device), reserved=device in reserved)
                  for device, load in ((d, ledger.loads[d]) for d in accelerators))
    order = tuple(largest_first(request.requests))
    index = {component.name: i for i, component in enumerate(order)}
    graph = request.costs.graph
    edges, fixed = [], []
    for a, b in graph.edges:
        if a in index and b in index:
            edges.append((index[a], index[b]))
        elif a in index or b in index:
            inside, outside = (a, b) if a in index else (b, a)
            if outside in request.placed:
                fixed.append((index[inside], request.placed[outside].plan.execution_device))
    problem = Problem(items=tuple(Item(name=c.name, weights=c.bytes, transient=c.transient) for c in order),
                      slots=slots, edges=tuple(edges), fixed_edges=tuple(fixed),
                      preferred=zigzag_slots(len(order), accelerators, reserved))
    return problem, order


def zigzag_slots(count: int, accelerators: Sequence[Device], reserved: Sequence[Device]) -> Optional[tuple[int, ...]]:
    """diffusers' map: the i-th largest component on the i-th accelerator of 0, 1, ..., n-1, n-1, ..., 0."""
    turns = [i for i, device in enumerate(accelerators) if device not in reserved]
    if not turns:
        return None
    zigzag = turns + turns[::-1]
    return tuple(zigzag[i % len(zigzag)] for i in range(count))


def largest_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.bytes, request.position))


def place_balanced(request: StrategyRequest) -> PlacementState:
    low_0 = request.spec.kind is StrategyKind.BALANCED_LOW_0
    optimal = place_whole_optimally(request, low_0=low_0)
    if optimal is not None:
        return optimal
    return place_zigzag_with_fallbacks(request, low_0=low_0)


def place_zigzag_with_fallbacks(request: StrategyRequest, *, low_0: bool) -> PlacementState:
    """The zig-zag, largest first and least divisible first, with the fallback chain; the better of the two."""
    best: Optional[tuple[int, PlacementState]] = None  # (bytes off the accelerators, the state)
    first_error: Optional[PlacementError] = None
    for order in (largest_first(request.requests), least_divisible_first(request.requests)):
        try:
            attempt = _attempt(order, request, low_0=low_0)
        except PlacementError as error:  # e.g. needs the disk without an offload folder
            first_error = first_error or error
            continue
        if best is None or attempt[0] < best[0]:
            best = attempt
        if best[0] == 0:
            break
    if best is None:
        raise first_error
    return best[1]


def _attempt(order: Sequence[ComponentRequest], request: StrategyRequest, *,
             low_0: bool) -> tuple[int, PlacementState]:
    ledger, placements = request.start()
    accelerators = ledger.accelerators
    reserved = reserved_zero(accelerators, low_0)
    turns = [device for device in accelerators if device not in reserved]
    for index, component in zip(zigzag_slots(len(order), accelerators, reserved) or (), order):
        turn = accelerators[index]
        others = sorted((d for d in turns if d != turn),
                        key=lambda d: (-ledger.room(d, transient=component.transient), d))
        placements.add(place_with_fallbacks(component, ledger, request.context, [turn, *others, *reserved]))
    off = sum(host_bytes(placements.by_name[component.name].plan) for component in order)
    return off, PlacementState.of(ledger, placements)


def least_divisible_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.size.largest_unit, -request.bytes, request.position))
