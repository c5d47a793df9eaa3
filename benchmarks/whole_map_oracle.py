"""The yardstick of issue 11: the best whole-component assignment, by brute force, under the Plan's memory model.

A device's predicted peak is its weights + the largest activation among the components executing there + the
runtime overhead once it is used (only when activations are accounted), as `placement.memory_model` computes
it; the score of a map is its fullest device's peak / budget. `oracle` tries every assignment of whole
components to the GPUs (at most 8^5 here) and returns the best score and, among the maps within 5% of it
that fit, the fewest model-graph edges crossing devices. Independent of the planner's own search.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Mapping, Optional, Sequence

from placement import ACCELERATOR_RUNTIME_OVERHEAD

TOLERANCE = 0.05


@dataclass(frozen=True, kw_only=True)
class Optimum:
    share: float  # the best fullest share over whole maps that fit
    fewest_crossings: int  # among the maps within 5% of it that fit


def shares(
    device_map: Mapping[str, int], weights: Mapping[str, int], activations: Mapping[str, int],
    budgets: Mapping[int, int], *, accounted: bool,
) -> dict[int, float]:
    """Each GPU's predicted peak / budget under a map of whole components (components off the GPUs ignored)."""
    result = {}
    for gpu, budget in budgets.items():
        here = [c for c, d in device_map.items() if d == gpu]
        if not here:
            result[gpu] = 0.0
            continue
        peak = sum(weights[c] for c in here) + max(activations.get(c, 0) for c in here)
        result[gpu] = (peak + (ACCELERATOR_RUNTIME_OVERHEAD if accounted else 0)) / budget
    return result


def crossings(device_map: Mapping[str, object], edges: Sequence[tuple[str, str]]) -> int:
    return sum(1 for a, b in edges if a in device_map and b in device_map and device_map[a] != device_map[b])


def oracle(
    weights: Mapping[str, int], activations: Mapping[str, int], budgets: Mapping[int, int],
    edges: Sequence[tuple[str, str]], *, accounted: bool,
) -> Optional[Optimum]:
    names, gpus = list(weights), list(budgets)
    scored = []
    for assignment in product(gpus, repeat=len(names)):
        device_map = dict(zip(names, assignment))
        fullest = max(shares(device_map, weights, activations, budgets, accounted=accounted).values())
        if fullest <= 1.0:
            scored.append((fullest, crossings(device_map, edges)))
    if not scored:
        return None
    best = min(share for share, _ in scored)
    limit = min(1.0, best * (1 + TOLERANCE)) + 1e-12
    return Optimum(share=best, fewest_crossings=min(c for share, c in scored if share <= limit))
