"""Where this process stands in a `torchrun` launch, and the process group its replicas talk over.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node) for every process it
starts; a plain `python` run has none of them and is one process on the whole machine. Replicas exchange only
small Python objects (a plan, a status, PNG bytes), always over Gloo: with CUDA the default group is NCCL (for
the user's own collectives on GPU tensors) and a Gloo group is made beside it, so no exchange needs a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

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
        """Every rank's `value`, by rank."""
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
        """Destroy the process group if this Exchange made it. `wait_for_the_others` (the normal end of a job:
        every rank gets here): a barrier first, so that no rank tears its connections down while a peer is still
        finishing the last collective (Gloo aborts a process whose peer closes under it). Never after a failure:
        a rank stuck in a collective would keep the others waiting."""
        if self.owns_process_group and dist.is_initialized():
            if wait_for_the_others:
                dist.barrier(group=self.group)
            dist.destroy_process_group()
        self.owns_process_group = False
