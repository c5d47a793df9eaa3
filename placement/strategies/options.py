"""A component's options in the placement search (`search`) and the order it visits them in, cheapest bound
first. Demotions: sets of components streamed while the strategy places the others (offloaded components on one
device share ONE streaming room, so demoting one can bring another off the CPU). Residency levels x home: each
component WHOLE, FILL (what the other phases leave room for) or STREAM, the non-resident ones executing on one home
accelerator; all-FILL in execution order is the reference policy (benchmarks/reference_policy.py), so the search
never does worse than it.
"""

from __future__ import annotations

import heapq
import itertools
import math
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
    pooled: bool = False  # the host-homed blocks stream onto the accelerator running the last span (issue 39)

    def streamed(self, order: Sequence[ComponentRequest]) -> list[ComponentRequest]:
        """The components this option keeps wholly off the resident room (their bytes bound its cost)."""
        return [request for request, level in zip(order, self.levels) if level is Level.STREAM]


def priority_order(requests: Sequence[ComponentRequest], runs: Mapping[str, int]) -> list[ComponentRequest]:
    """The component that runs most first, then the largest, then execution order."""
    return sorted(requests, key=lambda r: (-runs.get(r.name, 1), -r.bytes, r.position))


def residency_choices(order: Sequence[ComponentRequest], homes: Sequence[int], runs: Mapping[str, int],
                      limit: int = EXACT_LIMIT, *, pooled: bool = False) -> Iterator[Choice]:
    """Every level x home combination (past `limit` the smallest components get fewer levels), those with the
    fewest bytes certainly moved (the STREAM ones') first; with `pooled` (several accelerators) each also with
    its streamed blocks streamed onto another accelerator."""
    options = [tuple(Level) for _ in order]
    by_size = sorted(range(len(order)), key=lambda i: (order[i].bytes, -i))
    for reduced in (Level.FILL, Level.STREAM), (Level.FILL,):
        for i in by_size:
            if math.prod(len(option) for option in options) * len(homes) <= limit:
                break
            options[i] = reduced
    combos = sorted(itertools.product(*options), key=lambda levels: least_moved(
        (r for r, level in zip(order, levels) if level is Level.STREAM), runs))
    for levels in combos:
        for home in homes:
            yield Choice(levels=levels, home=home)
            if pooled and any(level is not Level.WHOLE for level in levels):
                yield Choice(levels=levels, home=home, pooled=True)
        if all(level is Level.FILL for level in levels):  # the reference policy itself is one candidate
            yield from (Choice(levels=levels, home=home, in_order=True) for home in homes)


def demotion_sets(pool: Sequence[ComponentRequest], runs: Mapping[str, int]) -> Iterator[tuple[ComponentRequest, ...]]:
    """Every non-empty subset of `pool` up to EXHAUSTIVE_LIMIT components; past it the BEST_FIRST_LIMIT cheapest
    by bound, then everything streamed."""
    if len(pool) <= EXHAUSTIVE_LIMIT:  # smallest sets first, the least valuable (fewest runs, smallest) first
        ranked = sorted(pool, key=lambda r: (runs.get(r.name, 1), r.bytes, r.position))
        for size in range(1, len(ranked) + 1):
            yield from itertools.combinations(ranked, size)
        return
    yield from itertools.islice(best_first_sets(pool, runs), BEST_FIRST_LIMIT)
    yield tuple(pool)  # everything streamed: every component on an accelerator when one holds the largest working set


def best_first_sets(pool: Sequence[ComponentRequest], runs: Mapping[str, int]) -> Iterator[tuple[ComponentRequest, ...]]:
    """Every non-empty subset exactly once, cheapest bound first: from a set whose last item is i (items sorted by
    value), add item i+1 or replace i by i+1, a heap yielding the cheapest."""
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
