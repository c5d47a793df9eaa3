"""What a plan costs: the one formula for the bytes a call moves, the copy seconds compute does not hide of them
(`exposed_copy_seconds`), the stream buffer, the bounds derived from them, and the order candidate plans compare in
(`PlanCost`), read by the Plan, the time model, the transfer model, the search and the benchmarks alike, so that
bytes are counted in one place (docs/design.md, "When it does not fit").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence

import networkx as nx

from .devices import Device, is_accelerator
from .errors import PlanError
from .rates import DISK_BYTES_PER_S, ERROR_BAND

STREAM_BUFFER_BLOCKS = 2  # one block computing, the next one prefetched (on CUDA, on a side stream)


# What the formulas read of the planner's objects, named here so that this module imports none of them (it is a
# leaf: the Plan's records, the search and the streaming layout all import it).
class Unit(Protocol):
    """A transfer unit (`streaming.TransferUnit`): its bytes, and whether it is a streamable block."""

    bytes: int
    block: bool


class Demand(Protocol):
    """A component to place (`strategies.state.ComponentRequest`): its name and the bytes its call runs."""

    name: str
    active_bytes: int


class Transfer(Protocol):
    """A component's bytes moved per call (`plan_records.ComponentTransfer`)."""

    runs_per_call: int
    loaded_per_call_bytes: int
    streamed_per_run_bytes: int
    streamed_modules: list[str]
    per_call_devices: Mapping[str, int]
    streamed_devices: Mapping[str, int]
    bytes_per_call: int


class PlacedComponent(Protocol):
    """A component's placement (`plan_records.ComponentPlan`)."""

    kind: str
    bytes: int
    execution_device: Device
    placed_bytes: Mapping[Device, int]


class Peaks(Protocol):
    """The search's running memory account (`memory_model.Ledger`): each device's load has a `budget`."""

    loads: Mapping[Device, Any]
    accelerators: list[int]

    def peak(self, device: Device) -> int: ...


def bytes_per_call(*, loaded: int, streamed: int, runs: int) -> int:
    """Host -> accelerator bytes one call moves for a component: `loaded` once, `streamed` at each of its runs."""
    return loaded + runs * streamed


def stream_buffer(block_bytes: Iterable[int]) -> int:
    """The streamed blocks in flight at once (the largest ones): what streaming holds beyond the rest."""
    return sum(sorted(block_bytes, reverse=True)[:STREAM_BUFFER_BLOCKS])


def stream_buffer_by_size(counts: Mapping[int, int]) -> int:
    """`stream_buffer` of blocks given as size -> how many."""
    buffer, left = 0, STREAM_BUFFER_BLOCKS
    for size in sorted(counts, reverse=True):
        used = min(max(counts[size], 0), left)
        buffer, left = buffer + used * size, left - used
        if not left:
            break
    return buffer


def working_set(rest: int, block_bytes: Iterable[int]) -> int:
    """What a component streaming `block_bytes` holds on its execution device besides activations."""
    return rest + stream_buffer(block_bytes)


def minimum_phase_weights(host: Iterable[Unit]) -> int:
    """The least a component's host-homed units need on its execution device: its working set, all blocks streamed."""
    units = list(host)
    return working_set(sum(u.bytes for u in units if not u.block), (u.bytes for u in units if u.block))


def least_bytes_per_call(host: int, *, runs: int = 1) -> int:
    """The least a component with `host` bytes off the accelerators moves per call: each byte once."""
    return bytes_per_call(loaded=host, streamed=0, runs=runs)


def least_moved(components: Iterable[Demand], runs: Mapping[str, int]) -> int:
    """Bytes per call `components` move at least when none of their weights stays resident: each byte their call
    runs (`active_bytes`), once. The search's bound and the order it visits its options in."""
    return sum(least_bytes_per_call(c.active_bytes, runs=runs.get(c.name, 1)) for c in components)


def least_cost(components: Iterable[Demand], runs: Mapping[str, int]) -> "PlanCost":
    """The least a candidate keeping `components` off the resident room can cost: the search's one bound."""
    return PlanCost.at_least(least_moved(components, runs))


def streaming_premium(streamed: int, runs: int) -> int:
    """What streaming `streamed` bytes at every run moves beyond loading them once per call."""
    return bytes_per_call(loaded=0, streamed=streamed, runs=runs) - bytes_per_call(loaded=streamed, streamed=0,
                                                                                  runs=runs)


def least_streamed_per_run(weights: int, room: int, block_bytes: Sequence[int]) -> Optional[int]:
    """The fewest bytes a component of `weights` streams per run when its phase holds at most `room` of them: the
    excess plus its smallest blocks in flight; None when it has no block to stream, 0 when it fits."""
    if weights <= room:
        return 0
    if not block_bytes:
        return None
    return weights - room + stream_buffer(sorted(block_bytes)[:STREAM_BUFFER_BLOCKS])


def exposed_copy_seconds(*, run_s: float, weight_bytes: int, loaded_bytes: int, streamed_bytes: int,
                         streamed_blocks: int, runs: int, link: float, overlap: bool = True,
                         links: int = 1) -> float:
    """Copy seconds per call compute does not hide: the per-call loads whole (nothing is known to leave room for
    them earlier), plus at every run each streamed block's copy beyond the compute since it was sent. The runtime
    sends a block when the streamed one before it starts (one side stream); the kept compute is spread evenly
    over the gaps, blocks equal in size and compute per byte (a DiT's). Synchronous copies (`overlap=False`,
    sequential offload) are exposed whole. Streamed blocks alternating between `links` GPUs (pooled residency: each
    GPU's own host link and prefetch chain, each block sent when its chain's previous one starts) arrive one per
    1/`links` of a copy when copies bound the run: the same steady state as one chain on a link `links` times as
    fast, so they are priced so (the activations' hops between the GPUs are not priced)."""
    exposed = loaded_bytes / link
    if not streamed_bytes:
        return exposed
    if not overlap or streamed_blocks < 1:
        return exposed + runs * streamed_bytes / link
    block_bytes = streamed_bytes / streamed_blocks
    copy, compute = block_bytes / link, run_s * block_bytes / max(weight_bytes, 1)
    gap = run_s * max(weight_bytes - streamed_bytes, 0) / max(weight_bytes, 1) / streamed_blocks  # kept, before each
    copy /= max(links, 1)
    per_run = max(0.0, copy - gap) + (streamed_blocks - 1) * max(0.0, copy - compute - gap)
    return exposed + runs * per_run


def stream_links(streamed_devices) -> int:
    """How many host links a component's streamed blocks come over: its execution device's, and one per other
    accelerator it streams blocks onto (`ComponentTransfer.streamed_devices`, pooled residency)."""
    return 1 + len(set(streamed_devices.values()))


def copy_bandwidth(kind: str, link: float, disk: float = DISK_BYTES_PER_S) -> float:
    """The bytes/s copies of a component placed `kind` ("disk": disk-homed) get: the link's, capped at the disk's."""
    return min(link, disk) if kind == "disk" else link



@dataclass(frozen=True, kw_only=True)
class PlanCost:
    """Lower is better, field by field: CPU-executed weights (a CPU forward is 10-100x slower than streaming the
    same weights) dominate; then the copy seconds compute does not hide, closer than the error band of the call's
    seconds (`seconds_tie`, the band's share of the compute, plus its share of the smaller exposed) counting as
    equal (the model is an estimate); then bytes per call, crossing edges, the components split over several
    accelerators (`split_components`: a split is a fallback, so of two plans moving the same bytes the one keeping
    more components whole wins, however much emptier the other's fullest accelerator), the fullest accelerator's
    share.
    Components placed before the strategy (pinned) count in none. Ties go to the candidate tried first."""

    cpu_bytes: int
    exposed_seconds: float = 0.0
    transfer_bytes: int
    crossing_edges: int
    split_components: int = 0
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
        tie = max(self.seconds_tie, other.seconds_tie)
        if tie > 0:  # the band of the faster candidate's whole call: its compute and its exposed copies
            tie += SECONDS_TIE_SHARE * min(self.exposed_seconds, other.exposed_seconds)
        if abs(gap) > tie:
            return -1 if gap < 0 else 1
        mine = (self.transfer_bytes, self.crossing_edges, self.split_components, self.fullest_share)
        theirs = (other.transfer_bytes, other.crossing_edges, other.split_components, other.fullest_share)
        return (mine > theirs) - (mine < theirs)

    @classmethod
    def at_least(cls, transfer_bytes: int) -> "PlanCost":
        """The least cost of a candidate that moves at least `transfer_bytes` per call."""
        return cls(cpu_bytes=0, exposed_seconds=0.0, transfer_bytes=transfer_bytes, crossing_edges=0,
                   fullest_share=0.0)


# Never trade certain bytes for uncertain seconds: exposed seconds closer than the time model's error band of the
# call's seconds tie, and bytes decide. The model predicts published runs to +-15% (`rates.ERROR_BAND`), so a
# plan that moves 12x the bytes to be predicted 4% faster is not worth its copies, its pinned RAM and the bus it
# shares with the other GPUs (sd35-large on 2x12 GiB, H100 profile: benchmarks/transfers.py --gpu h100).
SECONDS_TIE_SHARE = ERROR_BAND


@dataclass(frozen=True, kw_only=True)
class Timing:
    """What predicts a candidate's exposed copy seconds: each component's seconds per run (0 where its FLOPs are
    not known: its copies hide behind nothing), the link's and the disk's bytes/s, and the seconds tie."""

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

    def exposed(self, parts: Iterable[tuple]) -> float:
        """Exposed copy seconds per call, as the Plan's `seconds_per_call` counts them, summed over `parts`:
        (name, weight bytes, loaded, streamed, streamed blocks, runs, kind or host: "disk" reads at the disk's
        speed, and optionally how many host links its streamed blocks alternate over, `stream_links`);
        rounded to the microsecond, so float noise between two equal candidates never outranks bytes."""
        return round(sum(exposed_copy_seconds(
            run_s=self.run_seconds.get(name, 0.0), weight_bytes=weight_bytes, loaded_bytes=loaded,
            streamed_bytes=streamed, streamed_blocks=blocks, runs=runs, link=copy_bandwidth(kind, self.link, self.disk),
            links=links[0] if links else 1)
            for name, weight_bytes, loaded, streamed, blocks, runs, kind, *links in parts), 6)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What the cost needs to know of the pipeline: its graph and how often each component runs per call."""

    graph: nx.DiGraph
    runs: Mapping[str, int]  # runs_per_call per module component (1 when not given)
    timing: Optional[Timing] = None  # None: no component's FLOPs are known, the objective is bytes only

    @classmethod
    def build(cls, graph: nx.DiGraph, requests: Sequence[Demand],
              runs: Optional[Mapping[str, int]] = None, timing: Optional[Timing] = None) -> "CostModel":
        """`runs` as given (validated by the planner); else each graph node's `runs_per_call`, else 1."""
        given = dict(runs or {})
        known = {name: given.get(name, runs_per_call(graph, name)) for name in graph.nodes}
        known.update({r.name: given.get(r.name, known.get(r.name, 1)) for r in requests})
        return cls(graph=graph, runs=known, timing=timing)

    def cost(self, plans: Mapping[str, PlacedComponent], transfers: Mapping[str, Transfer], ledger: Peaks) -> PlanCost:
        """The cost of a complete set of placements: `plans` of every component placed, `transfers` of the
        components the strategy placed (the ones that count)."""
        cpu = sum(plans[name].bytes for name in transfers if not is_accelerator(plans[name].execution_device))
        executing = {name: plan.execution_device for name, plan in plans.items()}
        moved = sum(transfer.bytes_per_call for transfer in transfers.values())
        exposed = 0.0
        if self.timing is not None:
            exposed = self.timing.exposed(
                (name, plans[name].bytes, t.loaded_per_call_bytes, t.streamed_per_run_bytes, len(t.streamed_modules),
                 t.runs_per_call, plans[name].kind, stream_links(t.streamed_devices))
                for name, t in transfers.items() if is_accelerator(plans[name].execution_device) and t.bytes_per_call)
        spans = ([*(d for d, n in plans[name].placed_bytes.items() if n), plans[name].execution_device,
                  *t.per_call_devices.values(), *t.streamed_devices.values()] for name, t in transfers.items())
        return self.of(cpu_bytes=cpu, transfer_bytes=moved, executing=executing, ledger=ledger, exposed_seconds=exposed,
                       spans=spans)

    def of(self, *, cpu_bytes: int, transfer_bytes: int, executing: Mapping[str, Device], ledger: Peaks,
           exposed_seconds: float = 0.0, spans: Iterable[Iterable[Device]] = ()) -> PlanCost:
        """The cost from its parts: `executing` maps each placed component to its execution device, `spans` lists
        per component the devices it keeps weights on, executes on or loads blocks onto."""
        return PlanCost(cpu_bytes=cpu_bytes, exposed_seconds=exposed_seconds, transfer_bytes=transfer_bytes,
                        crossing_edges=crossings(self.graph, executing), split_components=split_components(spans),
                        fullest_share=fullest_share(ledger), seconds_tie=0.0 if self.timing is None else self.timing.tie)


def split_components(spans: Iterable[Iterable[Device]]) -> int:
    """How many components span more than one accelerator (`spans`: the devices of each): a split is only a
    fallback when whole does not fit, and every split changes device inside the component at each of its runs."""
    return sum(1 for devices in spans if len({d for d in devices if is_accelerator(d)}) > 1)


def crossings(graph: nx.DiGraph, executing: Mapping[str, Device]) -> int:
    """How many edges between placed components join two different execution devices (self-loops never do)."""
    return sum(1 for a, b in graph.edges
               if a != b and a in executing and b in executing and executing[a] != executing[b])


def fullest_share(ledger: Peaks) -> float:
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


def host_bytes(plan: PlacedComponent) -> int:
    """Weight bytes the plan keeps off the accelerators (CPU RAM, disk)."""
    return sum(n for device, n in plan.placed_bytes.items() if not is_accelerator(device))
