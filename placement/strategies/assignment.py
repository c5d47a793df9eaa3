"""The best whole-component assignment to accelerators: an exact branch and bound over the memory model's peaks.

Phase 1 minimises (weights on `reserved` devices, the fullest device's peak / budget), exactly; phase 2, among the
maps within `TOLERANCE` of that optimum, the fewest crossing model-graph edges, then the fewest components away
from the preferred (zig-zag) map, stopping after PHASE2_NODE_LIMIT nodes with a map within the tolerance anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

TOLERANCE = 0.05
PHASE2_NODE_LIMIT = 5_000  # per phase 2 pass: a few tenths of a second of Python at worst


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One accelerator as the search sees it: its budget and what it already holds."""

    device: Hashable
    budget: Optional[int]  # None: unlimited
    weights: int = 0
    transient: int = 0
    used: bool = False
    overhead: int = 0  # charged once the device holds or runs anything
    reserved: bool = False  # "balanced_low_0"'s GPU 0: its weights are minimised before anything else


@dataclass(frozen=True, kw_only=True)
class Item:
    name: str
    weights: int
    transient: int


@dataclass(frozen=True, kw_only=True)
class Problem:
    items: tuple[Item, ...]
    slots: tuple[Slot, ...]
    edges: tuple[tuple[int, int], ...] = ()  # model-graph edges between items (indices into items)
    fixed_edges: tuple[tuple[int, Hashable], ...] = ()  # (item, device of an already placed neighbour)
    preferred: Optional[tuple[int, ...]] = None  # the preferred map: a slot index per item


@dataclass(frozen=True, kw_only=True)
class Assignment:
    slots: tuple[int, ...]  # a slot index per item
    fullest: float  # the fullest device's peak / budget
    optimum: float  # phase 1's best fullest share
    reserved_weights: int
    crossings: int
    moved: int  # items away from the preferred map


class _Loads:
    """Weights, largest transient and item count per slot, updated as the search assigns and undoes."""

    def __init__(self, slots: Sequence[Slot]):
        self.slots = slots
        self.weights = [0] * len(slots)
        self.transients = [0] * len(slots)
        self.counts = [0] * len(slots)

    def peak(self, s: int, item: Optional[Item] = None) -> int:
        slot = self.slots[s]
        weights = slot.weights + self.weights[s] + (item.weights if item else 0)
        transient = max(slot.transient, self.transients[s], item.transient if item else 0)
        used = slot.used or self.counts[s] > 0 or item is not None
        return weights + transient + (slot.overhead if used else 0)

    def share(self, s: int, item: Optional[Item] = None) -> float:
        budget = self.slots[s].budget
        peak = self.peak(s, item)
        if budget is None:
            return 0.0
        return peak / budget if budget else (math.inf if peak else 0.0)

    def fits(self, s: int, item: Item) -> bool:
        budget = self.slots[s].budget
        return budget is None or self.peak(s, item) <= budget

    def push(self, s: int, item: Item) -> tuple[int, int]:
        undo = (self.transients[s], s)
        self.weights[s] += item.weights
        self.transients[s] = max(self.transients[s], item.transient)
        self.counts[s] += 1
        return undo

    def pop(self, item: Item, undo: tuple[int, int]) -> None:
        transient, s = undo
        self.weights[s] -= item.weights
        self.transients[s] = transient
        self.counts[s] -= 1

    def fullest(self) -> float:
        return max((self.share(s) for s in range(len(self.slots))), default=0.0)


def _loaded(problem: Problem, slots: Sequence[int]) -> _Loads:
    loads = _Loads(problem.slots)
    for item, s in zip(problem.items, slots):
        loads.push(s, item)
    return loads


def fullest_share(problem: Problem, slots: Sequence[int]) -> float:
    """The fullest device's peak / budget under an assignment (devices holding nothing new count too)."""
    return _loaded(problem, slots).fullest()


def slot_peaks(problem: Problem, slots: Sequence[int]) -> list[int]:
    """Each device's predicted peak under an assignment, in slot order."""
    loads = _loaded(problem, slots)
    return [loads.peak(s) for s in range(len(problem.slots))]


def crossings(problem: Problem, slots: Sequence[int]) -> int:
    devices = [problem.slots[s].device for s in slots]
    inside = sum(1 for a, b in problem.edges if slots[a] != slots[b])
    return inside + sum(1 for i, device in problem.fixed_edges if devices[i] != device)


def best_assignment(problem: Problem, tolerance: float = TOLERANCE, *, prefer: bool = True) -> Optional[Assignment]:
    """The preferred assignment within `tolerance` of the optimum; None when no whole assignment fits.
    `prefer=False` stops at the fewest crossings (skips the moves from the preferred map: the slow pass)."""
    if not problem.items:
        return Assignment(slots=(), fullest=0.0, optimum=0.0, reserved_weights=0, crossings=0, moved=0)
    first = _Phase1(problem).run()
    if first is None:
        return None
    optimum_slots, (reserved, optimum) = first
    limit = max(min(1.0, optimum * (1 + tolerance)), optimum)
    # The fewest crossings first, over maps up to exchanging interchangeable devices (fast); then the fewest
    # moves from the preferred map among those with that many crossings (device labels matter there).
    fewest = _Phase2(problem, limit=limit, reserved=reserved, start=optimum_slots, prefer=False).run()
    chosen = _Phase2(problem, limit=limit, reserved=reserved, start=fewest, prefer=True).run() if prefer else fewest
    return Assignment(
        slots=chosen, fullest=fullest_share(problem, chosen), optimum=optimum, reserved_weights=reserved,
        crossings=crossings(problem, chosen), moved=away_from_preferred(problem, chosen),
    )


def away_from_preferred(problem: Problem, slots: Sequence[int]) -> int:
    """Items away from the preferred map."""
    if problem.preferred is None:
        return 0
    return sum(1 for s, p in zip(slots, problem.preferred) if s != p)


def _order(problem: Problem) -> list[int]:
    """Largest first: big components decide the bound early."""
    return sorted(range(len(problem.items)), key=lambda i: (-(problem.items[i].weights + problem.items[i].transient), i))


def symmetry_classes(slots: Sequence[Slot]) -> list[tuple]:
    """Per slot, what makes two empty slots interchangeable."""
    return [(s.budget, s.weights, s.transient, s.used, s.overhead, s.reserved) for s in slots]


class _Search:
    """Depth first over whole assignments, largest item first; of interchangeable empty slots only the first is
    tried. A node carries its key (compared with the best complete one) and the weights on reserved slots."""

    node_limit = math.inf

    def __init__(self, problem: Problem, best: Optional[tuple] = None, best_slots: Optional[tuple[int, ...]] = None):
        self.problem, self.items = problem, problem.items
        self.order = _order(problem)
        self.loads = _Loads(problem.slots)
        self.classes = symmetry_classes(problem.slots)
        self.assigned = [-1] * len(self.items)
        self.nodes = 0
        self.best, self.best_slots = best, best_slots

    def _dfs(self, depth: int, key: tuple, reserved: int) -> None:
        self.nodes += 1
        if depth == len(self.order):
            if self.best is None or key < self.best:
                self.best, self.best_slots = key, tuple(self.assigned)
            return
        if self.nodes > self.node_limit or (self.best is not None and self._bound(depth, key) >= self.best):
            return
        item_index = self.order[depth]
        item = self.items[item_index]
        for s in self._children(item_index):
            now_reserved = reserved + (item.weights if self.problem.slots[s].reserved else 0)
            child = self._step(key, now_reserved, item_index, s)
            if child is None or (self.best is not None and child >= self.best):
                continue
            undo = self.loads.push(s, item)
            self.assigned[item_index] = s
            self._dfs(depth + 1, child, now_reserved)
            self.loads.pop(item, undo)
        self.assigned[item_index] = -1

    def _children(self, item_index: int) -> list[int]:
        """Slots that admit the item, in `_rank` order; one empty slot per class of interchangeable ones."""
        item, wanted = self.items[item_index], self._wanted()
        seen, children = set(), []
        for s in range(len(self.problem.slots)):
            if self.loads.counts[s] == 0 and s not in wanted:
                if self.classes[s] in seen:
                    continue
                seen.add(self.classes[s])
            if self._admissible(s, item):
                children.append(s)
        return sorted(children, key=lambda s: self._rank(item_index, s))

    def _wanted(self) -> set[int]:
        return set()

    def _admissible(self, s: int, item: Item) -> bool:
        return self.loads.fits(s, item)


class _Phase1(_Search):
    """Minimise (weights on reserved devices, fullest share) over whole assignments that fit."""

    def __init__(self, problem: Problem):
        super().__init__(problem)
        budgets = [s.budget for s in problem.slots]
        self.global_bound = 0.0
        if all(b for b in budgets):
            total = sum(s.weights for s in problem.slots) + sum(i.weights for i in self.items)
            self.global_bound = total / sum(budgets)

    def run(self) -> Optional[tuple[tuple[int, ...], tuple[int, float]]]:
        self._dfs(0, (0, self.loads.fullest()), 0)  # devices that get nothing new still count as they are
        if self.best is None or self.best_slots is None:
            return None
        return self.best_slots, self.best

    def _step(self, key: tuple, reserved: int, item_index: int, s: int) -> tuple:
        return reserved, max(key[1], self.loads.share(s, self.items[item_index]))

    def _rank(self, item_index: int, s: int) -> tuple:
        return self.problem.slots[s].reserved, self.loads.share(s, self.items[item_index]), s

    def _bound(self, depth: int, key: tuple) -> tuple:
        """Each remaining item on its best slot, and the total weights over the total budget."""
        bound = max(key[1], self.global_bound)
        for item_index in self.order[depth:]:
            item = self.items[item_index]
            best = min((self.loads.share(s, item) for s in range(len(self.problem.slots))), default=math.inf)
            bound = max(bound, best)
        return key[0], bound


class _Phase2(_Search):
    """Among maps within the share limit, the fewest crossing edges, then the fewest moves from the preferred."""

    node_limit = PHASE2_NODE_LIMIT

    def __init__(self, problem: Problem, *, limit: float, reserved: int, start: tuple[int, ...], prefer: bool):
        super().__init__(problem, (crossings(problem, start), away_from_preferred(problem, start) if prefer else 0),
                         start)
        self.preferred = problem.preferred if prefer else None
        self.limit = limit * (1 + 1e-12)
        self.reserved_limit = reserved
        rank = {item: depth for depth, item in enumerate(self.order)}
        self.earlier = [[] for _ in self.items]  # neighbours assigned before each item
        for a, b in problem.edges:
            later, first = (a, b) if rank[a] > rank[b] else (b, a)
            self.earlier[later].append(first)
        self.fixed = [[] for _ in self.items]
        for i, device in problem.fixed_edges:
            self.fixed[i].append(device)

    def run(self) -> tuple[int, ...]:
        self._dfs(0, (0, 0), 0)
        return self.best_slots

    def _step(self, key: tuple, reserved: int, item_index: int, s: int) -> Optional[tuple]:
        if reserved > self.reserved_limit:
            return None
        moved = int(self.preferred is not None and self.preferred[item_index] != s)
        return key[0] + self._new_crossings(item_index, s), key[1] + moved

    def _rank(self, item_index: int, s: int) -> tuple:
        preferred = None if self.preferred is None else self.preferred[item_index]
        return s != preferred, self._new_crossings(item_index, s), s

    def _admissible(self, s: int, item: Item) -> bool:
        return self.loads.fits(s, item) and self.loads.share(s, item) <= self.limit

    def _wanted(self) -> set[int]:
        """Slots the preferred map gives to an item not yet assigned: exchanging such an empty slot with an
        identical one changes the moves, so only the others are interchangeable."""
        if self.preferred is None:
            return set()
        return {self.preferred[i] for i, s in enumerate(self.assigned) if s < 0}

    def _new_crossings(self, item_index: int, s: int) -> int:
        inside = sum(1 for j in self.earlier[item_index] if self.assigned[j] != s)
        device = self.problem.slots[s].device
        return inside + sum(1 for fixed in self.fixed[item_index] if fixed != device)

    def _bound(self, depth: int, key: tuple) -> tuple:
        """Edges from an assigned item to a remaining one its device can no longer admit each cross (rooms only
        shrink deeper down); remaining items their preferred slot can no longer take each move."""
        crossed = moved = 0
        for i in self.order[depth:]:
            item = self.items[i]
            crossed += sum(1 for j in self.earlier[i]
                           if self.assigned[j] >= 0 and not self._admissible(self.assigned[j], item))
            moved += self.preferred is not None and not self._admissible(self.preferred[i], item)
        return key[0] + crossed, key[1] + moved
