"""What one candidate plan costs, so the searches (demotions, residency) can keep the best one.

Candidates are compared by `PlanCost`, field by field (lexicographically), lowest first:

1. `cpu_bytes`: weights of the components that execute on the CPU. A CPU forward is one to two orders
   of magnitude slower than streaming the same weights over the bus, so this dominates everything else.
2. `transfer_bytes`: host -> accelerator bytes per call in steady state (`transfers.completion`): what each
   component loads once per call plus its runs x what it streams per run. A component that runs every step
   (`runs_per_call`) thus weighs its runs times more than one that runs once.
3. `crossing_edges`: model-graph edges whose two ends run on different devices (a copy per call each).
4. `fullest_share`: the fullest accelerator's predicted peak / budget (the balanced objective).

Only the components the strategy places count toward 1-2 (components passed in already placed are the
same in every candidate). Ties go to the candidate tried first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

import networkx as nx

from ..devices import is_accelerator
from ..errors import PlanError
from ..graph import crossing_edges
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan
from ..transfers.completion import transfer_bytes
from .request import ComponentRequest, Placed


@dataclass(frozen=True, kw_only=True, order=True)
class PlanCost:
    """Lower is better; compared field by field in this order (see the module doc)."""

    cpu_bytes: int
    transfer_bytes: int
    crossing_edges: int
    fullest_share: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What the cost needs to know of the pipeline: its graph and how often each component runs per call."""

    graph: nx.DiGraph
    runs: Mapping[str, int]  # runs_per_call per module component (1 when not given)

    @classmethod
    def build(cls, graph: nx.DiGraph, requests: Sequence[ComponentRequest],
              runs: Optional[Mapping[str, int]] = None) -> "CostModel":
        """`runs` as given (validated by the planner); else each graph node's `runs_per_call`, else 1."""
        given = dict(runs or {})
        known = {name: given.get(name, runs_per_call(graph, name)) for name in graph.nodes}
        known.update({r.name: given.get(r.name, known.get(r.name, 1)) for r in requests})
        return cls(graph=graph, runs=known)

    def cost(self, by_name: Mapping[str, Placed], placed_here: Collection[str], ledger: Ledger,
             requests: Mapping[str, ComponentRequest]) -> PlanCost:
        """The cost of a complete set of placements; `placed_here`: the components the strategy placed."""
        plans = {name: placed.plan for name, placed in by_name.items()}
        cpu = sum(plan.bytes for name, plan in plans.items() if name in placed_here and _on_cpu(plan))
        ours = {name: requests[name] for name in placed_here if name in requests}
        executing = {name: plan.execution_device for name, plan in plans.items()}
        return PlanCost(
            cpu_bytes=cpu,
            transfer_bytes=transfer_bytes(by_name, ours, ledger, self.runs),
            crossing_edges=len(crossing_edges(self.graph.subgraph(executing), executing)),
            fullest_share=fullest_share(ledger),
        )


def fullest_share(ledger: Ledger) -> float:
    """The fullest budgeted accelerator's predicted peak as a share of its budget."""
    shares = [ledger.peak(d) / ledger.loads[d].budget for d in ledger.accelerators if ledger.loads[d].budget]
    return max(shares, default=0.0)


def runs_per_call(graph: nx.DiGraph, name: str) -> int:
    """The node's `runs_per_call` (a denoiser runs once per step), 1 when absent; anything else is an error."""
    runs = graph.nodes[name].get("runs_per_call", 1) if name in graph else 1
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise PlanError(
            f"Model graph node {name!r} has runs_per_call={runs!r}; it must be an int >= 1 (how many times "
            "the component runs per pipeline call, e.g. the number of denoising steps). Fix or drop it."
        )
    return runs


def _on_cpu(plan: ComponentPlan) -> bool:
    return not is_accelerator(plan.execution_device)


def host_bytes(plan: ComponentPlan) -> int:
    """Weight bytes the plan keeps off the accelerators (CPU RAM, disk)."""
    return sum(n for device, n in plan.placed_bytes.items() if not is_accelerator(device))
