"""What one candidate plan costs, so the demotion search can keep the best one.

Candidates are compared by `PlanCost`, field by field (lexicographically), lowest first:

1. `cpu_bytes`: weights of the components that execute on the CPU. A CPU forward is one to two orders
   of magnitude slower than streaming the same weights over the bus, so this dominates everything else.
2. `anchor_streamed`: 1 when the component that runs most (`runs_per_call` on its graph node; without it,
   the largest -- the denoiser) is not resident on accelerators. It runs once per denoising step: keep it
   whole (or split) whenever some plan with equally little on the CPU allows it.
3. `streamed_bytes`: bytes copied from CPU RAM or disk to an accelerator per pipeline call: the host-held
   weights of every component executing on an accelerator, times its `runs_per_call` (1 when not given).
4. `crossing_edges`: model-graph edges whose two ends run on different devices (a copy per call each).

Only the components the strategy places count toward 1-3 (components passed in already placed are the
same in every candidate). Ties go to the candidate tried first (fewer demotions, see `demotion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

import networkx as nx

from ..devices import is_accelerator
from ..graph import crossing_edges
from ..plan_schema import ComponentPlan, PlacementKind
from ..errors import GraphError
from .request import ComponentRequest, Placed

RESIDENT_KINDS = (PlacementKind.WHOLE, PlacementKind.SPLIT)


@dataclass(frozen=True, kw_only=True, order=True)
class PlanCost:
    """Lower is better; compared field by field in this order (see the module doc)."""

    cpu_bytes: int
    anchor_streamed: int
    streamed_bytes: int
    crossing_edges: int


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What the cost needs to know of the pipeline: its graph, how often each component runs, the anchor."""

    graph: nx.DiGraph
    runs: Mapping[str, int]  # runs_per_call per module component (1 when the graph does not say)
    anchor: Optional[str]  # the component that runs most, else the largest (None: nothing to place)

    @classmethod
    def build(cls, graph: nx.DiGraph, requests: Sequence[ComponentRequest]) -> "CostModel":
        runs = {name: runs_per_call(graph, name) for name in graph.nodes}  # every module component is a node
        anchor = min(requests, key=lambda r: (-runs[r.name], -r.bytes, r.position), default=None)
        return cls(graph=graph, runs=runs, anchor=None if anchor is None else anchor.name)

    def cost(self, by_name: Mapping[str, Placed], placed_here: Collection[str]) -> PlanCost:
        """The cost of a complete set of placements; `placed_here`: the components the strategy placed."""
        plans = {name: placed.plan for name, placed in by_name.items()}
        cpu = sum(plan.bytes for name, plan in plans.items() if name in placed_here and _on_cpu(plan))
        streamed = sum(
            host_bytes(plan) * self.runs.get(name, 1)
            for name, plan in plans.items()
            if name in placed_here and not _on_cpu(plan)
        )
        anchor = plans.get(self.anchor) if self.anchor in placed_here else None
        executing = {name: plan.execution_device for name, plan in plans.items()}
        graph = self.graph.subgraph(executing)
        return PlanCost(
            cpu_bytes=cpu,
            anchor_streamed=int(anchor is not None and anchor.kind not in RESIDENT_KINDS),
            streamed_bytes=streamed,
            crossing_edges=len(crossing_edges(graph, executing)),
        )


def runs_per_call(graph: nx.DiGraph, name: str) -> int:
    """The node's `runs_per_call` (a denoiser runs once per step), 1 when absent; anything else is an error."""
    runs = graph.nodes[name].get("runs_per_call", 1) if name in graph else 1
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise GraphError(
            f"Model graph node {name!r} has runs_per_call={runs!r}; it must be an int >= 1 (how many times "
            "the component runs per pipeline call, e.g. the number of denoising steps). Fix or drop it."
        )
    return runs


def _on_cpu(plan: ComponentPlan) -> bool:
    return not is_accelerator(plan.execution_device)


def host_bytes(plan: ComponentPlan) -> int:
    """Weight bytes the plan keeps off the accelerators (CPU RAM, disk)."""
    return sum(n for device, n in plan.placed_bytes.items() if not is_accelerator(device))
