"""Whole components onto accelerators by the exact search of `assignment`, the familiar zig-zag preferred.

The devices the search sees are the ledger's accelerators with what they already hold (pinned components).
The preferred map is diffusers' zig-zag: components largest first (ties in execution order) over
0, 1, ..., n-1, n-1, ..., 0 -- for "balanced_low_0" over the accelerators other than 0, and 0 is `reserved`
(its weights minimised first). Interchangeable devices are then used from the lowest index up
(`fill_from_first`): a map that leaves GPU 0 empty beside an identical, used GPU 1 is the same map on GPU 0.
The search returns None when no whole assignment fits; the strategy then falls back (split, offload, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..devices import Device
from .assignment import Assignment, Item, Problem, Slot, best_assignment
from .fallbacks import place_whole
from .map_reasons import left_empty, map_reasons
from .request import ComponentRequest
from .state import PlacementState, StrategyRequest


@dataclass(frozen=True, kw_only=True)
class WholeSearch:
    """The search problem built from a strategy request, with the order components are placed in."""

    problem: Problem
    order: tuple[ComponentRequest, ...]  # largest first (the zig-zag's order), also the placement order
    reserved: tuple[int, ...]


def place_whole_optimally(request: StrategyRequest, *, low_0: bool) -> Optional[PlacementState]:
    """Every component whole where the fullest device is within 5% of the best; None when that cannot fit."""
    search = build_search(request, low_0=low_0)
    found = best_assignment(search.problem, prefer=request.thorough)
    if found is None:
        return None
    found = fill_from_first(search.problem, found)
    ledger, placements = request.start()
    for index, component in enumerate(search.order):
        device = search.problem.slots[found.slots[index]].device
        placements.add(place_whole(component, ledger, device))
    reasons = map_reasons(search.problem, found, names=[c.name for c in search.order])
    return PlacementState.of(ledger, placements, map_reasons=tuple(reasons),
                             left_empty=left_empty(search.problem, found))


def fill_from_first(problem: Problem, found: Assignment) -> Assignment:
    """The same map with interchangeable devices (same budget, same load before) relabelled so that the lower
    ones are used first: at equal cost, a small pipeline goes to GPU 0, not to GPU 1 beside an empty GPU 0
    (issue 21). Fullest share and crossings are unchanged by such a relabelling; the moves from the zig-zag map
    are recounted."""
    classes = _classes(problem)
    relabel: dict[int, int] = {}
    for members in classes.values():
        used = [s for s in members if s in found.slots]
        relabel.update(zip(used, members[: len(used)]))
    slots = tuple(relabel.get(s, s) for s in found.slots)
    if slots == found.slots:
        return found
    moved = 0 if problem.preferred is None else sum(1 for s, p in zip(slots, problem.preferred) if s != p)
    return replace(found, slots=slots, moved=moved)


def _classes(problem: Problem) -> dict[tuple, list[int]]:
    classes: dict[tuple, list[int]] = {}
    for index, slot in enumerate(problem.slots):
        key = (slot.budget, slot.weights, slot.transient, slot.used, slot.overhead, slot.reserved)
        classes.setdefault(key, []).append(index)
    return classes


def build_search(request: StrategyRequest, *, low_0: bool) -> WholeSearch:
    ledger = request.ledger
    accelerators = ledger.accelerators
    reserved = (0,) if low_0 and 0 in accelerators and len(accelerators) > 1 else ()
    slots = tuple(
        Slot(
            device=device, budget=ledger.loads[device].budget, weights=ledger.loads[device].weights,
            transient=ledger.loads[device].transient, used=ledger.loads[device].used,
            overhead=ledger.overhead(device), reserved=device in reserved,
        )
        for device in accelerators
    )
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
    problem = Problem(
        items=tuple(Item(name=c.name, weights=c.bytes, transient=c.transient) for c in order),
        slots=slots, edges=tuple(edges), fixed_edges=tuple(fixed),
        preferred=zigzag_slots(len(order), accelerators, reserved),
    )
    return WholeSearch(problem=problem, order=order, reserved=reserved)


def zigzag_slots(count: int, accelerators: Sequence[Device], reserved: Sequence[Device]) -> Optional[tuple[int, ...]]:
    """diffusers' map: the i-th largest component on the i-th accelerator of 0, 1, ..., n-1, n-1, ..., 0."""
    turns = [i for i, device in enumerate(accelerators) if device not in reserved]
    if not turns:
        return None
    zigzag = turns + turns[::-1]
    return tuple(zigzag[i % len(zigzag)] for i in range(count))


def largest_first(requests: Sequence[ComponentRequest]) -> list[ComponentRequest]:
    return sorted(requests, key=lambda request: (-request.bytes, request.position))


__all__ = ["Assignment", "WholeSearch", "build_search", "largest_first", "place_whole_optimally", "zigzag_slots"]
