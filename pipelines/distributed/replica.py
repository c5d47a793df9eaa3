"""`load_replica()`: inside a `torchrun` launch, this process's replica of a pipeline and its share of the work.

    replica = load_replica("my-pipeline", prompts, torch_dtype=torch.bfloat16, call={"height": 1024, "width": 1024})
    for index, prompt in replica.share:               # every world_size-th input, by index
        image = replica.pipe(prompt, generator=torch.Generator().manual_seed(index)).images[0]
    everything = replica.gather(results)              # on rank 0: every rank's results; elsewhere None

Every rank takes the same steps, so none waits for a collective another skips. Local rank 0 of each node plans
the node's replicas (`placement.plan_replicas`, on meta) and every rank takes that plan: plans made per rank
could differ as free memory moves, and one node's groups must be disjoint. Each rank loads onto its group (the
group's `max_memory`, so it plans exactly that group), or without accelerators onto the CPU (GPU budgets or a
`group_size` there are an error, never ignored). A status is then all-gathered, so a failure on one rank raises
ReplicaLoadError on all, naming each failed rank. Replicas exchange only small objects, always over Gloo (a
Gloo group beside NCCL under CUDA), so no exchange needs a GPU.

Why not `accelerate.PartialState` (its `split_between_processes`, `utils.gather_object`): a replica is a GPU group,
and PartialState sets each process's CUDA device to `cuda:<local rank>` when it starts (a CUDA context on another
group's GPU when groups hold more than one); its `gather_object` all-gathers over the default group (NCCL under
CUDA: every status exchange would need a GPU, even one reporting that planning failed before any was chosen),
flattens one level of what each rank sends (a rank's `(label, place, error)` tuple comes back as loose items), and
has no gather to rank 0 alone; and its split gives contiguous chunks, where rounds of one image per rank want every
`world_size`-th input, so the images finish, and a stopped run resumes, in input order."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

import placement
from placement.budgets import exact_budgets
from placement.devices import detect_accelerators, device_label, is_accelerator
from placement.errors import PlacementError

from ..errors import ReplicaLoadError
from ..folder.model_index import ModelIndex
from ..folder.sources import component_sources, load_non_module, resolve_pipeline_folder
from ..framework.pipeline import Pipeline
from ..loading.assembly import check_constructor, construct_pipeline
from ..loading.meta import build_from_source
from ..loading.planning import call_activations
from ..loading.request import DtypeRequest


DEFAULT_TIMEOUT = timedelta(minutes=30)  # how long a rank waits for the others (a slow load, a lost node)


@dataclass(frozen=True, kw_only=True)
class Launch:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the replica of this node this process runs
    local_world_size: int = 1
    node: int = 0
    distributed: bool = False

    @classmethod
    def from_env(cls) -> "Launch":
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        world_size = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]), world_size=world_size, local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)), node=int(env.get("GROUP_RANK", 0)),
            distributed=True,
        )  # fmt: skip

    @property
    def label(self) -> str:
        return f"rank {self.rank} (node {self.node}, local rank {self.local_rank})"


class Exchange:
    """Object collectives among the launch's processes (a no-op pass-through in a plain run)."""

    def __init__(self, launch: Launch, *, timeout: timedelta = DEFAULT_TIMEOUT):
        self.launch = launch
        self.owns_process_group = False
        self.group = None
        if not launch.distributed:
            return
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend, timeout=timeout)
            self.owns_process_group = True
        gloo = dist.get_backend() == "gloo"
        self.group = dist.group.WORLD if gloo else dist.new_group(backend="gloo", timeout=timeout)

    def all_gather(self, value: Any) -> list[Any]:
        if not self.launch.distributed:
            return [value]
        gathered: list[Any] = [None] * self.launch.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def gather_to_first(self, value: Any) -> Optional[list[Any]]:
        """Every rank's `value` on rank 0 (by rank); None on the others."""
        if not self.launch.distributed:
            return [value]
        gathered: Optional[list[Any]] = [None] * self.launch.world_size if self.launch.rank == 0 else None
        dist.gather_object(value, gathered, dst=0, group=self.group)
        return gathered

    def close(self, *, wait_for_the_others: bool = False) -> None:
        """Destroy the process group if this Exchange made it; `wait_for_the_others` (a normal end) barriers first, as
        Gloo aborts a process whose peer closes under it. Never after a failure: a stuck rank would keep all waiting."""
        if self.owns_process_group and dist.is_initialized():
            if wait_for_the_others:
                dist.barrier(group=self.group)
            dist.destroy_process_group()
        self.owns_process_group = False


def plan_pipeline_replicas(pipeline_class: type, pretrained: str | Path, *, max_memory: Optional[Mapping] = None,
                           torch_dtype=None, call: Optional[Mapping[str, Any]] = None,
                           group_size: Optional[int] = None, strategy: str = "balanced") -> placement.ReplicaPlan:
    folder = resolve_pipeline_folder(pretrained, weights=False)
    index = ModelIndex.read(folder)
    check_constructor(pipeline_class, index, {})
    sources = component_sources(index, folder, skip={})
    dtypes = DtypeRequest.parse(torch_dtype)
    dtypes.check_names([name for name, source in sources.items() if source.is_module], of="pipeline")
    components = {
        name: build_from_source(source, dtype=dtypes.for_component(name), variant=None, weights_required=False).module
        if source.is_module else load_non_module(source)
        for name, source in sources.items()
    }
    pipe = construct_pipeline(pipeline_class, index, components)
    modules = pipe.module_components
    activations = None if call is None else call_activations(pipe, modules, call, torch_dtype=torch_dtype)
    return placement.plan_replicas(modules, max_memory=max_memory, graph=pipe.graph_edges, dtype=torch_dtype,
                                   activations=activations, group_size=group_size, strategy=strategy)


def folder_pipeline_class(pretrained: str | Path) -> type:
    """The folder's class when it is one of this library's pipelines (its own `__call__` applies), else `Pipeline`."""
    import pipelines

    from ..framework.pipeline import Pipeline

    found = getattr(pipelines, ModelIndex.read(resolve_pipeline_folder(pretrained, weights=False)).class_name, None)
    return found if isinstance(found, type) and issubclass(found, Pipeline) else Pipeline


@dataclass(kw_only=True)
class Replica:
    """This process's replica: the placed pipeline, its GPU group (None on the CPU), its share of the inputs."""

    pipe: Any
    launch: Launch
    group: Optional[placement.ReplicaGroup]
    share: list[tuple[int, Any]]  # (input index, input): every world_size-th input from this rank's
    exchange: Exchange = field(repr=False)

    def gather(self, results: Sequence[Any]) -> Optional[list[Any]]:
        """Every rank's `results` concatenated on rank 0 in rank order (None elsewhere)."""
        gathered = self.exchange.gather_to_first(list(results))
        return None if gathered is None else [item for part in gathered for item in part]

    def all_gather(self, value: Any) -> list[Any]:
        return self.exchange.all_gather(value)

    def close(self, *, wait_for_the_others: bool = False) -> None:
        self.exchange.close(wait_for_the_others=wait_for_the_others)

    def __enter__(self) -> "Replica":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait_for_the_others=exc_type is None)


def load_replica(pretrained: str | Path, inputs: Sequence[Any], *, pipeline_class: Optional[type] = None,
                 torch_dtype=None, max_memory: Optional[Mapping] = None, call: Optional[Mapping[str, Any]] = None,
                 group_size: Optional[int] = None, strategy: str = "balanced",
                 timeout: timedelta = DEFAULT_TIMEOUT, progress: Optional[bool] = None) -> Replica:
    """This rank's replica of the pipeline in `pretrained` and its share of `inputs` (see the module doc); run
    plainly, one replica over the whole machine (`device_map=strategy`) with all the inputs."""
    launch = Launch.from_env()
    exchange = Exchange(launch, timeout=timeout)
    cls = pipeline_class or folder_pipeline_class(pretrained)
    options = dict(torch_dtype=torch_dtype, call=call, progress=launch.rank == 0 if progress is None else progress)
    if not launch.distributed:  # one process, the whole machine: errors surface as they are
        pipe = cls.from_pretrained(pretrained, device_map=strategy, max_memory=max_memory, **options)
        return Replica(pipe=pipe, launch=launch, group=None, share=list(enumerate(inputs)), exchange=exchange)
    group, pipe, error = None, None, None
    try:
        group = _node_group(exchange, cls, pretrained, max_memory=max_memory, torch_dtype=torch_dtype, call=call,
                            group_size=group_size, strategy=strategy)
        pipe = _load_on_group(cls, pretrained, group, strategy=strategy, max_memory=max_memory, options=options)
    except Exception as failure:  # reported to every rank below, so that none hangs waiting for this one
        error = _reason(failure)
    _check_everyone_loaded(exchange, launch, group, error)
    share = [(index, item) for index, item in enumerate(inputs) if index % launch.world_size == launch.rank]
    return Replica(pipe=pipe, launch=launch, group=group, share=share, exchange=exchange)


def _node_group(exchange: Exchange, cls, pretrained, **planning) -> Optional[placement.ReplicaGroup]:
    """This rank's GPU group from its node's replica plan (made by local rank 0); None without GPUs."""
    launch = exchange.launch
    mine = None
    if launch.local_rank == 0:
        try:
            if _has_accelerators(planning["max_memory"], planning["group_size"]):
                mine = ("plan", plan_pipeline_replicas(cls, pretrained, **planning).to_json(indent=None))
        except Exception as failure:  # every rank must reach the all_gather below, whatever went wrong
            mine = ("error", _reason(failure))
    entries = exchange.all_gather((launch.node, launch.local_rank, mine))
    found = next((found for node, local, found in entries if node == launch.node and local == 0), None)
    kind, payload = found or (None, None)
    if kind is None:
        return None  # no accelerators on this node: every rank runs on the CPU
    if kind == "error":
        raise ReplicaLoadError(f"planning the replicas of node {launch.node} failed: {payload}")
    replicas = placement.ReplicaPlan.from_json(payload)
    if replicas.replicas < launch.local_world_size:
        raise ReplicaLoadError(
            f"node {launch.node} holds {replicas.replicas} replica(s) ({replicas.verdict}), and torchrun started "
            f"{launch.local_world_size} processes on it; launch with --nproc_per_node {max(replicas.replicas, 1)} "
            "or fewer (or give --group-size / max_memory)."
        )
    return replicas.group(launch.local_rank)


def _reason(failure: Exception) -> str:
    """A typed error's message says it all; anything else is named by its type too."""
    return str(failure) if isinstance(failure, PlacementError) else f"{type(failure).__name__}: {failure}"


def _has_accelerators(max_memory: Optional[Mapping], group_size: Optional[int]) -> bool:
    """Whether this node plans replicas over accelerators; without any, GPU budgets or a group size are an error."""
    if detect_accelerators().count:
        return True
    check_gpu_budgets_have_gpus(max_memory, group_size=group_size, runs="every replica would run")
    return False


def check_gpu_budgets_have_gpus(max_memory: Optional[Mapping], *, group_size: Optional[int] = None,
                                runs: str = "the pipeline would run") -> None:
    """On a machine without accelerators, budgets naming GPUs (or a GPU group size) are an error, never ignored: a
    run given them would run on the CPU anyway, and its plan's advice would speak of GPUs it does not have."""
    if detect_accelerators().count:
        return
    named = [device_label(key) for key in map(placement.normalize_device, max_memory or {}) if is_accelerator(key)]
    if named or group_size is not None:
        asked = f"max_memory names {', '.join(named)}" if named else f"group_size={group_size} asks for GPU groups"
        raise ReplicaLoadError(
            f"{asked}, but this machine has no accelerator (no CUDA, XPU or MPS device is visible), so {runs} on "
            "the CPU. Give budgets only for cpu and disk (or none), run on a machine with GPUs, or set "
            "PLACEMENT_VIRTUAL_ACCELERATORS=N to try N CPU-backed accelerators (replicas, groups and budgets then "
            "behave as on GPUs). To see where it would go on those GPUs, plan it (`placement plan`, or "
            "plan_placement in Python): a plan is made for any budgets."
        )


def _load_on_group(cls, pretrained, group: Optional[placement.ReplicaGroup], *, strategy, max_memory,
                   options) -> Pipeline:
    if group is None:  # no accelerator: the CPU, within its budget when one is given
        if max_memory:
            return cls.from_pretrained(pretrained, device_map=strategy, max_memory=max_memory, **options)
        return cls.from_pretrained(pretrained, device_map="cpu", **{**options, "call": None})
    accelerators = detect_accelerators()
    if accelerators.kind == "cuda" and not accelerators.virtual:
        torch.cuda.set_device(group.accelerators[0])  # this rank's CUDA work (and NCCL) defaults to its group
    return cls.from_pretrained(pretrained, device_map=strategy, max_memory=exact_budgets(group.max_memory), **options)


def _check_everyone_loaded(exchange: Exchange, launch: Launch, group, error: Optional[str]) -> None:
    where = "the CPU" if group is None else group.label
    statuses = exchange.all_gather((launch.label, where, error))
    reasons = [why for _, _, why in statuses if why is not None]
    if not reasons:
        return
    exchange.close()
    if len(reasons) == len(statuses) > 1 and len(set(reasons)) == 1:  # one cause everywhere: say it once
        raise ReplicaLoadError(f"Replica load failed on all {len(statuses)} ranks: {reasons[0]}")
    failed = [f"{label} on {place}: {why.rstrip('.')}" for label, place, why in statuses if why is not None]
    raise ReplicaLoadError("Replica load failed on " + "; ".join(failed) + ".")
