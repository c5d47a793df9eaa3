"""What a plan costs: the one formula for the bytes a call moves, the stream buffer streaming needs, the bounds
derived from them, and the order in which candidate plans compare.

Bytes per call (docs/design.md, "When it does not fit"): a component that executes on an accelerator with weights
homed on the host moves what it loads once per call (`loaded`), plus, at each of its `runs` runs, what it streams
block by block (`streamed`): `bytes_per_call`. While it streams, its execution device holds its host-homed rest
(needed for the whole run) and the blocks in flight: one block computes while the next is prefetched, so the
STREAM_BUFFER_BLOCKS largest streamed blocks (`stream_buffer`, `working_set`). The Plan, the transfer model, the
searches and their bounds, the runtime's room bookkeeping and the benchmarks all read these functions, so how
bytes are counted and how deep the prefetch goes are decided here and nowhere else.

Candidates are compared by `PlanCost`, field by field (lexicographically), lowest first:

1. `cpu_bytes`: weights of the components that execute on the CPU. A CPU forward is one to two orders
   of magnitude slower than streaming the same weights over the bus, so this dominates everything else.
2. `exposed_seconds`: the copy seconds per call that compute does not hide (`time_model.exposed_copy_seconds`),
   when the plan knows its components' FLOPs (`Timing`; 0 for every candidate otherwise). The objective is the
   predicted seconds of a call; compute on the accelerators is the same in every candidate, so what differs is
   this: a plan may move more bytes when they hide behind compute. Seconds closer than `SECONDS_TIE_SHARE` of the
   call's compute tie, and bytes break ties.
3. `transfer_bytes`: host -> accelerator bytes per call in steady state, `bytes_per_call` summed over the
   components. A component that runs every step (`runs_per_call`) thus weighs its runs times more than one
   that runs once.
4. `crossing_edges`: model-graph edges whose two ends run on different devices (a copy per call each).
5. `fullest_share`: the fullest accelerator's predicted peak / budget (the balanced objective).

Only the components the strategy places count toward 1-3 (components passed in already placed are the
same in every candidate). Ties go to the candidate tried first.

This module imports nothing of the transfer model or the strategies (they import it): what it reads of their
objects is typed under TYPE_CHECKING only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

import networkx as nx

from .devices import Device, is_accelerator
from .errors import PlanError
from .time_model import DISK_BYTES_PER_S, exposed_copy_seconds

if TYPE_CHECKING:
    from .memory_model import Ledger
    from .plan_schema import ComponentPlan, ComponentTransfer
    from .strategies.state import ComponentRequest
    from .streaming import TransferUnit

STREAM_BUFFER_BLOCKS = 2  # one block computing, the next one prefetched (on CUDA, on a side stream)


def bytes_per_call(*, loaded: int, streamed: int, runs: int) -> int:
    """Host -> accelerator bytes one call moves for a component: `loaded` once, `streamed` at each of its runs."""
    return loaded + runs * streamed


def stream_buffer(block_bytes: Iterable[int]) -> int:
    """The streamed blocks in flight at once (the largest ones): what streaming holds beyond the rest."""
    return sum(sorted(block_bytes, reverse=True)[:STREAM_BUFFER_BLOCKS])


def stream_buffer_by_size(counts: Mapping[int, int]) -> int:
    """`stream_buffer` of blocks given as size -> how many (a search that moves blocks in and out by size)."""
    buffer, left = 0, STREAM_BUFFER_BLOCKS
    for size in sorted(counts, reverse=True):
        used = min(max(counts[size], 0), left)
        buffer, left = buffer + used * size, left - used
        if not left:
            break
    return buffer


def working_set(rest: int, block_bytes: Iterable[int]) -> int:
    """What a component that streams `block_bytes` holds on its execution device at once besides activations:
    its `rest` (everything it needs for the whole run) and the blocks in flight."""
    return rest + stream_buffer(block_bytes)


def minimum_phase_weights(host: Iterable[TransferUnit]) -> int:
    """The least a component's host-homed units need on its execution device: they all stream (the rest cannot:
    it is loaded), so its working set."""
    units = list(host)
    return working_set(sum(u.bytes for u in units if not u.block), (u.bytes for u in units if u.block))


def least_bytes_per_call(host: int, *, runs: int = 1) -> int:
    """The least a component with `host` bytes homed off the accelerators moves per call (whatever its split):
    each of them once, all loaded per call (streaming them moves as much or more). The searches prune with it."""
    return bytes_per_call(loaded=host, streamed=0, runs=runs)


def least_moved(components: Iterable[ComponentRequest], runs: Mapping[str, int]) -> int:
    """Bytes per call `components` move at least when none of their weights stays resident: every byte their
    call runs (`active_bytes`: the blocks it never runs move nothing), each once. The search's bound
    (`least_cost`) and the order it visits its options in are this number."""
    return sum(least_bytes_per_call(c.active_bytes, runs=runs.get(c.name, 1)) for c in components)


def least_cost(components: Iterable[ComponentRequest], runs: Mapping[str, int]) -> "PlanCost":
    """The least a candidate that keeps `components` off the accelerators' resident room can cost: the one
    bound of the placement search (`strategies.search`), which stops once its best plan is no dearer."""
    return PlanCost.at_least(least_moved(components, runs))


def streaming_premium(streamed: int, runs: int) -> int:
    """What streaming `streamed` bytes at every run moves beyond loading them once per call."""
    return bytes_per_call(loaded=0, streamed=streamed, runs=runs) - bytes_per_call(loaded=streamed, streamed=0,
                                                                                  runs=runs)


def least_streamed_per_run(weights: int, room: int, block_bytes: Sequence[int]) -> Optional[int]:
    """The fewest bytes a component of `weights` must stream per run when its phase can hold at most `room` of
    them: the excess, plus the room the blocks in flight take at the least (its smallest blocks). None when it
    has no block to stream (it cannot run in that room at all); 0 when it fits."""
    if weights <= room:
        return 0
    if not block_bytes:
        return None
    return weights - room + stream_buffer(sorted(block_bytes)[:STREAM_BUFFER_BLOCKS])


@dataclass(frozen=True, kw_only=True)
class PlanCost:
    """Lower is better; compared field by field in this order (see the module doc), exposed seconds closer than
    `seconds_tie` counting as equal."""

    cpu_bytes: int
    exposed_seconds: float = 0.0
    transfer_bytes: int
    crossing_edges: int
    fullest_share: float = 0.0
    seconds_tie: float = field(default=0.0, compare=False)  # `Timing.tie`: 0 when no FLOPs are known

    def __lt__(self, other: "PlanCost") -> bool:
        return self._rank(other) < 0

    def __le__(self, other: "PlanCost") -> bool:
        return self._rank(other) <= 0

    def _rank(self, other: "PlanCost") -> int:
        """-1, 0 or 1 as `self` costs less than, as much as or more than `other`."""
        if self.cpu_bytes != other.cpu_bytes:
            return -1 if self.cpu_bytes < other.cpu_bytes else 1
        gap = self.exposed_seconds - other.exposed_seconds
        if abs(gap) > max(self.seconds_tie, other.seconds_tie):
            return -1 if gap < 0 else 1
        mine = (self.transfer_bytes, self.crossing_edges, self.fullest_share)
        theirs = (other.transfer_bytes, other.crossing_edges, other.fullest_share)
        return (mine > theirs) - (mine < theirs)

    @classmethod
    def at_least(cls, transfer_bytes: int) -> "PlanCost":
        """The least cost a candidate that moves at least `transfer_bytes` per call can have: nothing on the
        CPU, every copy hidden, no edge crossing devices, every accelerator empty."""
        return cls(cpu_bytes=0, exposed_seconds=0.0, transfer_bytes=transfer_bytes, crossing_edges=0,
                   fullest_share=0.0)


# Exposed seconds closer than this share of the call's accelerator compute tie, and bytes decide: the time model
# is an estimate (its efficiencies are stated, not measured), so a plan that moves 2.6x the bytes to be predicted
# 0.6% faster is not worth its copies, its pinned RAM and the bus it shares with the other GPUs.
SECONDS_TIE_SHARE = 0.02


@dataclass(frozen=True, kw_only=True)
class Timing:
    """What predicts a candidate's exposed copy seconds: each component's seconds per run on the plan's GPU
    (`time_model.run_seconds`; 0 where its FLOPs are not known: its copies hide behind nothing), the host
    link's bytes/s (the one given or the named GPU's; a link measured once the plan is known comes later), the
    disk's read bytes/s, and the step below which two candidates' seconds tie (`SECONDS_TIE_SHARE`)."""

    run_seconds: Mapping[str, float]
    link: float
    disk: float = DISK_BYTES_PER_S
    tie: float = 1e-6

    @classmethod
    def build(cls, run_seconds: Mapping[str, float], runs: Mapping[str, int], *, link: float,
              disk: Optional[float] = None) -> "Timing":
        """`run_seconds` per component, run `runs` times a call (1 when not named)."""
        compute = sum(seconds * runs.get(name, 1) for name, seconds in run_seconds.items())
        return cls(run_seconds=run_seconds, link=link, disk=DISK_BYTES_PER_S if disk is None else disk,
                   tie=max(1e-6, SECONDS_TIE_SHARE * compute))

    def exposed(self, name: str, *, weight_bytes: int, loaded: int, streamed: int, blocks: int, runs: int,
                disk: bool) -> float:
        """The component's exposed copy seconds per call, as the Plan's `seconds_per_call` counts them."""
        link = min(self.link, self.disk) if disk else self.link
        return exposed_copy_seconds(run_s=self.run_seconds.get(name, 0.0), weight_bytes=weight_bytes,
                                    loaded_bytes=loaded, streamed_bytes=streamed, streamed_blocks=blocks,
                                    runs=runs, link=link)

    @staticmethod
    def total(seconds: Iterable[float]) -> float:
        """Seconds summed, to the microsecond: float noise between two equal candidates never outranks bytes."""
        return round(sum(seconds), 6)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What the cost needs to know of the pipeline: its graph and how often each component runs per call."""

    graph: nx.DiGraph
    runs: Mapping[str, int]  # runs_per_call per module component (1 when not given)
    timing: Optional[Timing] = None  # None: no component's FLOPs are known, the objective is bytes only

    @classmethod
    def build(cls, graph: nx.DiGraph, requests: Sequence[ComponentRequest],
              runs: Optional[Mapping[str, int]] = None, timing: Optional[Timing] = None) -> "CostModel":
        """`runs` as given (validated by the planner); else each graph node's `runs_per_call`, else 1."""
        given = dict(runs or {})
        known = {name: given.get(name, runs_per_call(graph, name)) for name in graph.nodes}
        known.update({r.name: given.get(r.name, known.get(r.name, 1)) for r in requests})
        return cls(graph=graph, runs=known, timing=timing)

    def cost(self, plans: Mapping[str, ComponentPlan], transfers: Mapping[str, ComponentTransfer],
             ledger: Ledger) -> PlanCost:
        """The cost of a complete set of placements: `plans` of every component placed, `transfers` of the
        components the strategy placed (the ones that count)."""
        cpu = sum(plans[name].bytes for name in transfers if not is_accelerator(plans[name].execution_device))
        executing = {name: plan.execution_device for name, plan in plans.items()}
        moved = sum(transfer.bytes_per_call for transfer in transfers.values())
        exposed = 0.0
        if self.timing is not None:
            exposed = self.timing.total(self.timing.exposed(
                name, weight_bytes=plans[name].bytes, loaded=t.loaded_per_call_bytes, streamed=t.streamed_per_run_bytes,
                blocks=len(t.streamed_modules), runs=t.runs_per_call, disk=plans[name].kind.value == "disk")
                for name, t in transfers.items() if is_accelerator(plans[name].execution_device) and t.bytes_per_call)
        return self.of(cpu_bytes=cpu, transfer_bytes=moved, executing=executing, ledger=ledger, exposed_seconds=exposed)

    def of(self, *, cpu_bytes: int, transfer_bytes: int, executing: Mapping[str, Device], ledger: Ledger,
           exposed_seconds: float = 0.0) -> PlanCost:
        """The cost from its parts: `executing` maps each placed component to its execution device."""
        return PlanCost(cpu_bytes=cpu_bytes, exposed_seconds=exposed_seconds, transfer_bytes=transfer_bytes,
                        crossing_edges=crossings(self.graph, executing), fullest_share=fullest_share(ledger),
                        seconds_tie=0.0 if self.timing is None else self.timing.tie)


def crossings(graph: nx.DiGraph, executing: Mapping[str, Device]) -> int:
    """How many edges between placed components join two different execution devices (self-loops never do)."""
    return sum(1 for a, b in graph.edges
               if a != b and a in executing and b in executing and executing[a] != executing[b])


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


def host_bytes(plan: ComponentPlan) -> int:
    """Weight bytes the plan keeps off the accelerators (CPU RAM, disk)."""
    return sum(n for device, n in plan.placed_bytes.items() if not is_accelerator(device))
