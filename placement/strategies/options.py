"""A component's options in the placement search (`search`), and the order the search visits them in.

The strategy's own plan (balanced or sequential, with its fallback chain: whole, split, offloaded, cpu, disk) is
the search's first candidate. Two families of options then keep components off the accelerators' resident room:

Demotions: a set D of components streamed from CPU RAM (the disk when RAM is short), each executing on the
accelerator with the most room for its streaming working set, while the strategy places the others. Offloaded
components on one device run one after another, so they share ONE streaming room (the largest working set
among them), where whole ones add up: demoting a resident component can let another execute on an accelerator
instead of the CPU. D ranges over the components that could stream at all. Up to EXHAUSTIVE_LIMIT of them every
subset is visited, smallest subsets first, the least valuable components (fewest runs per call, then smallest)
first; past it the subsets come best first, by what their demotion moves at least (`cost.least_moved`), at most
BEST_FIRST_LIMIT of them, and "all of them" (everything streamed) closes the family.

Residency levels (docs/design.md, "When it does not fit"): each component gets one of three levels, and every
component that is not resident executes on one `home` accelerator (their phases never overlap, so they share its
room, and what one phase leaves free there another can load per call):
- WHOLE: resident whole (or split along its blocks), placed first, on the accelerator with the most room
  once the home keeps room for the other components' phases;
- FILL: as many units resident as the other phases leave room for (`transfers.residency`), in priority order -- the
  component that runs most first, then the largest -- so a denoiser that cannot stay whole keeps what the
  others' phases allow, loads more at its phase and streams the remainder;
- STREAM: nothing resident; loaded per call and streamed at its phase.
What is not resident is split into loaded-per-call and streamed units in its own phase's room
(`transfers.residency`). Every level x home combination is visited (3^n x accelerators; a denoiser pipeline has
3 to 6 components) up to EXACT_LIMIT; past it the smallest components are only tried at FILL and STREAM, and past
that at FILL. All-FILL in priority order, blocks taken in execution order, is the reference policy
(benchmarks/reference_policy.py) on that home; it is one of the options, so the search never does worse than it.
The combinations come cheapest bound first: their STREAM components move every byte their call runs at least.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Mapping, Sequence

from ..cost import least_moved
from .state import ComponentRequest

EXHAUSTIVE_LIMIT = 8  # 2**8 - 1 = 255 demotion sets at most (a strategy run is milliseconds: splits are cached)
BEST_FIRST_LIMIT = 512  # demotion sets the best-first order yields at most past EXHAUSTIVE_LIMIT
EXACT_LIMIT = 2_000  # level x home combinations visited exhaustively (each is a fraction of a millisecond)


class Level(str, Enum):
    STREAM = "stream"
    FILL = "fill"
    WHOLE = "whole"


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One residency option: a level per component (in priority order) and the home accelerator."""

    levels: tuple[Level, ...]
    home: int
    in_order: bool = False  # FILL takes blocks in execution order (the reference policy's way), not largest first

    def streamed(self, order: Sequence[ComponentRequest]) -> list[ComponentRequest]:
        """The components this option keeps wholly off the resident room (their bytes bound its cost)."""
        return [request for request, level in zip(order, self.levels) if level is Level.STREAM]


def priority_order(requests: Sequence[ComponentRequest], runs: Mapping[str, int]) -> list[ComponentRequest]:
    """The component that runs most first, then the largest, then execution order."""
    return sorted(requests, key=lambda r: (-runs.get(r.name, 1), -r.bytes, r.position))


def residency_choices(order: Sequence[ComponentRequest], homes: Sequence[int], runs: Mapping[str, int],
                      limit: int = EXACT_LIMIT) -> Iterator[Choice]:
    """Every level x home combination (within `limit`, the smallest components get fewer levels), those with
    the fewest bytes certainly moved (the STREAM ones') first."""
    options = [tuple(Level) for _ in order]
    by_size = sorted(range(len(order)), key=lambda i: (order[i].bytes, -i))
    for reduced in (Level.FILL, Level.STREAM), (Level.FILL,):
        for i in by_size:
            if _count(options) * len(homes) <= limit:
                break
            options[i] = reduced
    combos = sorted(itertools.product(*options), key=lambda levels: least_moved(
        (r for r, level in zip(order, levels) if level is Level.STREAM), runs))
    for levels in combos:
        for home in homes:
            yield Choice(levels=levels, home=home)
        if all(level is Level.FILL for level in levels):  # the reference policy itself is one candidate
            yield from (Choice(levels=levels, home=home, in_order=True) for home in homes)


def _count(options) -> int:
    total = 1
    for option in options:
        total *= len(option)
    return total


def demotion_sets(pool: Sequence[ComponentRequest], runs: Mapping[str, int]) -> Iterator[tuple[ComponentRequest, ...]]:
    """The demotion sets the search visits (see the module doc), in its order."""
    if len(pool) <= EXHAUSTIVE_LIMIT:
        yield from candidate_sets(pool, runs)
        return
    yield from itertools.islice(best_first_sets(pool, runs), BEST_FIRST_LIMIT)
    yield tuple(pool)  # everything streamed: every component on an accelerator when one holds the largest working set


def candidate_sets(pool: Sequence[ComponentRequest], runs: Mapping[str, int]) -> Iterator[tuple[ComponentRequest, ...]]:
    """Non-empty sets to demote, smallest first; least valuable components (fewest runs, smallest) first."""
    ranked = sorted(pool, key=lambda r: (runs.get(r.name, 1), r.bytes, r.position))
    for size in range(1, len(ranked) + 1):
        yield from itertools.combinations(ranked, size)


def best_first_sets(pool: Sequence[ComponentRequest], runs: Mapping[str, int]) -> Iterator[tuple[ComponentRequest, ...]]:
    """Every non-empty subset exactly once, in increasing order of the bytes their demotion moves at least.

    The classic successor scheme over items sorted by value: from a set whose last item is i, either add
    item i+1 or replace i by i+1; a heap yields the sets cheapest first.
    """
    ranked = sorted(pool, key=lambda r: (least_moved([r], runs), r.position))
    values = [least_moved([r], runs) for r in ranked]
    heap = [(values[0], (0,))] if ranked else []
    while heap:
        total, indices = heapq.heappop(heap)
        yield tuple(ranked[i] for i in indices)
        last = indices[-1]
        if last + 1 < len(ranked):
            heapq.heappush(heap, (total + values[last + 1], indices + (last + 1,)))
            heapq.heappush(heap, (total - values[last] + values[last + 1], indices[:-1] + (last + 1,)))
