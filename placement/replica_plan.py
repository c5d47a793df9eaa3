"""The ReplicaPlan: copies of one pipeline, each placed on its own group of accelerators of one machine.

A frozen pydantic model like `Plan` (it holds one `Plan` per group), with a JSON round trip and `explain()`.
Device indices are the machine's real ones: the group {2, 3} holds a plan whose devices are 2 and 3.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import BaseModel, ConfigDict

from .devices import Device, is_accelerator
from .errors import PlanError
from .plan_schema import PlacementKind, Plan
from .sizes import format_bytes


class ReplicaFit(str, Enum):
    """How a group's plan runs. Only these two make a replica: a plan that executes a component on the CPU or
    serves weights from disk is too slow to be worth a copy."""

    RESIDENT = "resident"  # every component whole or split on the group's accelerators
    STREAMED = "streamed"  # some weights offloaded to CPU RAM, streamed to the group's accelerators per call


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReplicaGroup(_Frozen):
    """One replica: its accelerators (real indices, ascending), how it fits, and its placement plan."""

    replica: int  # 0, 1, ...: the local rank that takes this group under torchrun
    accelerators: list[int]
    fit: ReplicaFit
    plan: Plan

    @property
    def label(self) -> str:
        return group_label(self.accelerators)

    @property
    def max_memory(self) -> dict[Device, int]:
        """The budgets this replica was planned with ({2: ..., 3: ..., "cpu": its share}): what a load of
        this replica passes as `max_memory`, so it plans exactly this group."""
        return {entry.device: entry.budget for entry in self.plan.devices if entry.budget is not None}


class GroupSizeOption(_Frozen):
    """What one group size gives: the considered alternatives, for explain() and for benchmarks."""

    group_size: int
    replicas: int
    fit: Optional[ReplicaFit]  # None: no group of this size runs without the CPU or disk


class ReplicaPlan(_Frozen):
    group_size: int  # 0 when no group of any considered size holds a replica
    groups: list[ReplicaGroup]
    unused: list[int]  # accelerators in no group
    fit: Optional[ReplicaFit]
    options: list[GroupSizeOption]  # every group size considered, ascending
    cpu_share: Optional[int]  # the host RAM budget each group was planned with

    @property
    def replicas(self) -> int:
        return len(self.groups)

    def group(self, replica: int) -> ReplicaGroup:
        if not 0 <= replica < len(self.groups):
            raise PlanError(
                f"Replica {replica} does not exist: the plan has {len(self.groups)} replica(s) "
                f"({self.verdict}). Launch at most {len(self.groups)} process(es) per node."
            )
        return self.groups[replica]

    @property
    def verdict(self) -> str:
        """"4 replicas of 2 GPUs; GPU 0–1, 2–3, 4–5, 6–7" (or why there is none)."""
        if not self.groups:
            return "no replica fits: no group of GPUs runs the pipeline without executing on the CPU or disk"
        replicas = f"{len(self.groups)} replica{'s' if len(self.groups) > 1 else ''}"
        gpus = f"{self.group_size} GPU{'s' if self.group_size > 1 else ''}"
        labels = [group_label(group.accelerators) for group in self.groups]
        labels = [labels[0], *(label.removeprefix("GPU ") for label in labels[1:])]
        streamed = " (streamed: weights offloaded to CPU RAM)" if self.fit is ReplicaFit.STREAMED else ""
        return f"{replicas} of {gpus}{streamed}; {', '.join(labels)}"

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ReplicaPlan":
        return cls.model_validate_json(text)

    def explain(self) -> str:
        lines = [f"Replica plan: {self.verdict}", ""]
        lines += ["group size  replicas  fit"]
        for option in self.options:
            chosen = "  <- chosen" if option.group_size == self.group_size and self.groups else ""
            fit = option.fit.value if option.fit else "none (CPU or disk)"
            lines.append(f"{option.group_size:>10}  {option.replicas:>8}  {fit}{chosen}")
        if self.unused:
            lines += ["", f"Unused: {', '.join(f'GPU {index}' for index in self.unused)}"]
        if self.cpu_share is not None:
            lines += [f"Host RAM per replica: {format_bytes(self.cpu_share)}"]
        for group in self.groups:
            lines += ["", f"Replica {group.replica} on {group.label} ({group.fit.value}):", group.plan.explain()]
        return "\n".join(lines)


def group_label(accelerators: list[int]) -> str:
    """"GPU 2", "GPU 0–1" (a contiguous run), "GPU 0,3" (otherwise)."""
    ordered = sorted(accelerators)
    if len(ordered) == 1:
        return f"GPU {ordered[0]}"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"GPU {ordered[0]}–{ordered[-1]}"
    return "GPU " + ",".join(str(index) for index in ordered)


def replica_fit(plan: Plan) -> Optional[ReplicaFit]:
    """RESIDENT, STREAMED, or None when a component executes on the CPU or has weights on disk."""
    kinds = {component.kind for component in plan.components.values()}
    if kinds & {PlacementKind.CPU, PlacementKind.DISK}:
        return None
    if any(not is_accelerator(c.execution_device) for c in plan.components.values()):
        return None
    return ReplicaFit.STREAMED if PlacementKind.OFFLOADED in kinds else ReplicaFit.RESIDENT
