"""`load_replica()`: inside a `torchrun` launch, this process's replica of a pipeline and its share of the work.

    replica = load_replica("my-pipeline", prompts, torch_dtype=torch.bfloat16, call={"height": 1024, "width": 1024})
    for index, prompt in replica.share:               # every world_size-th input, by index
        image = replica.pipe(prompt, generator=torch.Generator().manual_seed(index)).images[0]
    everything = replica.gather(results)              # on rank 0: every rank's results; elsewhere None

Steps, the same on every rank so that none waits for a collective another skips:
1. With accelerators (CUDA, XPU, or the virtual ones of PLACEMENT_VIRTUAL_ACCELERATORS, which are planned,
   grouped and loaded exactly like GPUs): local rank 0 of each node plans the node's replicas
   (`placement.plan_replicas`, on meta; budgets detected unless `max_memory` is given; `group_size` GPUs each
   if given) and every rank takes its node's plan: plans made on each rank could differ (free memory moves),
   and the ranks of one node must agree on disjoint groups.
2. Each rank loads the pipeline onto the group of its local rank (`from_pretrained` with the group's
   `max_memory`, so it plans exactly that group; device indices are real). Without accelerators every rank
   loads onto the CPU (within `max_memory`'s "cpu" budget if given); GPU budgets or a `group_size` there are
   an error that says how to get accelerators (never silently ignored).
3. A status is all-gathered before any work: if one rank could not plan or load, every rank raises
   ReplicaLoadError naming each failed rank and why, so none is left waiting in a later collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

import placement
from placement.budgets import exact_budgets
from placement.devices import detect_accelerators, device_label, is_accelerator
from placement.errors import PlacementError

from ..errors import ReplicaLoadError
from ..framework.pipeline import Pipeline
from .launch import DEFAULT_TIMEOUT, Exchange, Launch
from .replica_planning import folder_pipeline_class, plan_pipeline_replicas


@dataclass(kw_only=True)
class Replica:
    """This process's replica: the placed pipeline, its GPU group (None on the CPU), its share of the inputs."""

    pipe: Any
    launch: Launch
    group: Optional[placement.ReplicaGroup]
    share: list[tuple[int, Any]]  # (input index, input): every world_size-th input from this rank's
    exchange: Exchange = field(repr=False)

    def gather(self, results: Sequence[Any]) -> Optional[list[Any]]:
        """Every rank's `results` concatenated on rank 0 (in rank order; None on the other ranks)."""
        gathered = self.exchange.gather_to_first(list(results))
        return None if gathered is None else [item for part in gathered for item in part]

    def all_gather(self, value: Any) -> list[Any]:
        return self.exchange.all_gather(value)

    def close(self, *, wait_for_the_others: bool = False) -> None:
        """Destroy the process group if `load_replica` created it (see `Exchange.close`)."""
        self.exchange.close(wait_for_the_others=wait_for_the_others)

    def __enter__(self) -> "Replica":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait_for_the_others=exc_type is None)


def load_replica(pretrained: str | Path, inputs: Sequence[Any], *, pipeline_class: Optional[type] = None,
                 torch_dtype=None, max_memory: Optional[Mapping] = None, call: Optional[Mapping[str, Any]] = None,
                 group_size: Optional[int] = None, strategy: str = "balanced",
                 timeout: timedelta = DEFAULT_TIMEOUT, progress: Optional[bool] = None) -> Replica:
    """This rank's replica of the pipeline in `pretrained` and its share of `inputs` (see the module doc).

    Run plainly (no torchrun) it is one replica on the whole machine: the pipeline placed over every GPU
    (`device_map=strategy`), all the inputs. `max_memory`: one node's budgets (default: detected).
    `pipeline_class`: the class to load as (default: the folder's own class when it is one of ours, else
    `pipelines.Pipeline`).
    """
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
    """This rank's GPU group from its node's replica plan (made by the node's local rank 0); None without GPUs."""
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
    """Whether this node plans replicas over accelerators; without any, GPU budgets or a group size are an
    error (they would otherwise be ignored: every rank runs on the CPU)."""
    if detect_accelerators().count:
        return True
    named = [device_label(key) for key in (max_memory or {}) if is_accelerator(placement.normalize_device(key))]
    if named or group_size is not None:
        asked = f"max_memory names {', '.join(named)}" if named else f"group_size={group_size} asks for GPU groups"
        raise ReplicaLoadError(
            f"{asked}, but this machine has no accelerator, so every replica would run on the CPU. Run on a "
            "machine with GPUs, or set PLACEMENT_VIRTUAL_ACCELERATORS=N to try N CPU-backed accelerators "
            "(replicas, groups and budgets then behave as on GPUs)."
        )
    return False


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
