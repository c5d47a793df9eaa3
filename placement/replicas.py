"""`placement.plan_replicas()`: as many copies of a pipeline as one machine's accelerators hold.

The accelerators are cut into disjoint groups of one size, each planned by `placement.plan` on its own budgets
(real device indices) and host RAM divided by the groups of that size the machine could form. A group counts only
if it runs without the CPU or disk: RESIDENT, or STREAMED only when no size gives a resident replica; the two never
mix, since prompts are shared equally and one slow replica would set the pace. The size giving the most replicas
wins, the smaller on a tie. GPUs of different sizes get an exact search over the ways to cut them (groups of the
lowest free indices first; equal budgets planned once); equal GPUs, or more than EXACT_SEARCH_LIMIT, are cut into
consecutive groups. Detected budgets within DETECTED_JITTER are evened down: identical GPUs report free memory
a few MiB apart.
"""

from __future__ import annotations

import warnings
from enum import Enum
from functools import lru_cache
from itertools import combinations
from typing import Callable, Mapping, Optional

from torch import nn

from .budgets import ZeroBudgetWarning, exact_budgets, resolve_budgets
from .devices import Device, is_accelerator
from .errors import DoesNotFitError, PlanError
from .plan_schema import FrozenModel, PlacementKind, Plan
from .planner import plan as plan_placement
from .sizes import format_bytes
from .strategies.state import NAMED_STRATEGIES, parse_strategy


class ReplicaFit(str, Enum):
    """How a group's plan runs; a plan on the CPU or from disk is too slow to be worth a copy."""

    RESIDENT = "resident"  # every component whole or split on the group's accelerators
    STREAMED = "streamed"  # some weights offloaded to CPU RAM, streamed to the group's accelerators per call




class ReplicaGroup(FrozenModel):
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
        """The budgets this replica was planned with: what a load of it passes as `max_memory`."""
        return {entry.device: entry.budget for entry in self.plan.devices if entry.budget is not None}


class GroupSizeOption(FrozenModel):
    """What one group size gives: the considered alternatives, for explain() and for benchmarks."""

    group_size: int
    replicas: int
    fit: Optional[ReplicaFit]  # None: no group of this size runs without the CPU or disk


class ReplicaPlan(FrozenModel):
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
    if PlacementKind.DISK in kinds or any(not is_accelerator(c.execution_device) for c in plan.components.values()):
        return None
    return ReplicaFit.STREAMED if PlacementKind.OFFLOADED in kinds else ReplicaFit.RESIDENT


Group = tuple[int, ...]  # accelerator indices, ascending
# Above this many accelerators of unequal sizes, groups are consecutive indices (the exact search is exponential).
EXACT_SEARCH_LIMIT = 12
DETECTED_JITTER = 0.02


def plan_replicas(
    components: Mapping[str, nn.Module],
    *,
    max_memory: Optional[Mapping],
    graph=None,
    dtype=None,
    activations: Optional[Mapping[str, int]] = None,
    group_size: Optional[int] = None,
    strategy: str = "balanced",
) -> ReplicaPlan:
    """Partition the accelerators of `max_memory` (one machine's; None: detected) into groups, one replica each.
    The other arguments are `placement.plan`'s; group_size: GPUs per replica (None: the size with most replicas)."""
    _check_strategy(strategy)
    budgets = resolve_budgets(max_memory)
    inventory = _even_out_detected({index: budgets.limit(index) for index in budgets.accelerators}, budgets.detected)
    if not inventory:
        raise PlanError(
            "Replicas need accelerators, and max_memory has none (no integer keys, or no GPU is visible). "
            "Pass max_memory={0: '24GiB', 1: '24GiB', ...} for the GPUs of one machine."
        )
    sizes = _group_sizes(group_size, len(inventory))
    search = _Search(inventory=inventory, cpu=budgets.limit("cpu"), plan_group=lambda group: plan_placement(
        components, max_memory=group, strategy=strategy, graph=graph, dtype=dtype, activations=activations))
    options = [search.option(size) for size in sizes]
    chosen = _choose(options)
    if chosen is None:
        return ReplicaPlan(
            group_size=0, groups=[], unused=sorted(inventory), fit=None, options=options, cpu_share=None
        )
    return search.materialize(chosen, options)


def _even_out_detected(inventory: dict[int, int], detected: frozenset) -> dict[int, int]:
    """Detected budgets within DETECTED_JITTER of the smallest of their kind are set to that smallest: free
    memory differs by a few MiB between identical GPUs, and equal budgets give equal groups (planned once)."""
    evened = dict(inventory)
    for index in sorted((i for i in inventory if i in detected), key=inventory.__getitem__):
        for other in detected:
            if other in inventory and inventory[index] <= inventory[other] <= inventory[index] * (1 + DETECTED_JITTER):
                evened[other] = min(evened[other], inventory[index])
    return evened


def _check_strategy(strategy) -> None:
    spec = parse_strategy(strategy)
    if spec.kind not in NAMED_STRATEGIES:
        raise PlanError(
            f"Replicas are planned with a named strategy ('balanced', 'auto', 'sequential', 'balanced_low_0'), "
            f"not {strategy!r}: a device map or a single device names GPUs that only one group contains."
        )


def _group_sizes(group_size: Optional[int], count: int) -> list[int]:
    if group_size is None:
        return list(range(1, count + 1))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= count:
        raise PlanError(
            f"group_size={group_size!r}: expected a whole number of GPUs from 1 to {count} (the accelerators in "
            "max_memory), or None to choose the size that gives the most replicas."
        )
    return [group_size]


def _choose(options: list[GroupSizeOption]) -> Optional[GroupSizeOption]:
    """Resident replicas if any size gives some, else streamed ones; most replicas, then the smaller group."""
    for fit in (ReplicaFit.RESIDENT, ReplicaFit.STREAMED):
        found = [option for option in options if option.fit is fit and option.replicas > 0]
        if found:
            return max(found, key=lambda option: (option.replicas, -option.group_size))
    return None


class _Search:
    """The exact search over which GPUs go together, for one machine's inventory."""

    def __init__(self, *, inventory: dict[int, int], cpu: int, plan_group: Callable[[dict], Plan]):
        self.inventory = inventory
        self.cpu = cpu
        self._plan_group = plan_group
        self._plans: dict[tuple, Optional[Plan]] = {}
        self._fits: dict[tuple, Optional[ReplicaFit]] = {}

    def plan(self, group: dict[int, int], cpu: int) -> Optional[Plan]:
        """The group's plan with `cpu` bytes of host RAM, or None when nothing places it without the disk."""
        key = (tuple(group.items()), cpu)
        if key not in self._plans:
            try:
                with warnings.catch_warnings():  # a GPU of no room was named once, when the budgets were read
                    warnings.simplefilter("ignore", ZeroBudgetWarning)
                    self._plans[key] = self._plan_group(exact_budgets({**group, "cpu": cpu}))
            except DoesNotFitError:
                self._plans[key] = None  # needs the disk (no offload folder is given) or fits nowhere
        return self._plans[key]

    def cpu_share(self, group_size: int) -> int:
        return self.cpu // (len(self.inventory) // group_size)

    def option(self, group_size: int) -> GroupSizeOption:
        for fit in (ReplicaFit.RESIDENT, ReplicaFit.STREAMED):
            packing = self.packing(group_size, fit)
            if packing:
                return GroupSizeOption(group_size=group_size, replicas=len(packing), fit=fit)
        return GroupSizeOption(group_size=group_size, replicas=0, fit=None)

    def group_fit(self, group: Group, group_size: int) -> Optional[ReplicaFit]:
        """How the group fits. The strategies see a group's budgets in index order (and "balanced_low_0"
        whether GPU 0 is in it), so groups alike in both are planned once."""
        key = (tuple(self.inventory[index] for index in group), 0 in group, group_size)
        if key not in self._fits:
            found = self.plan({index: self.inventory[index] for index in group}, self.cpu_share(group_size))
            self._fits[key] = None if found is None else replica_fit(found)
        return self._fits[key]

    def packing(self, group_size: int, fit: ReplicaFit) -> tuple[Group, ...]:
        """The most disjoint groups of `group_size` GPUs that each hold a replica of `fit` (STREAMED accepts
        either): groups of the lowest free GPUs tried first, so equal GPUs give 0–1, 2–3, ..."""

        def accepts(group: Group) -> bool:
            found = self.group_fit(group, group_size)
            return found is fit or (found is not None and fit is ReplicaFit.STREAMED)

        indices = tuple(sorted(self.inventory))
        if len(set(self.inventory.values())) == 1 or len(indices) > EXACT_SEARCH_LIMIT:
            chunks = [indices[i : i + group_size] for i in range(0, len(indices) - group_size + 1, group_size)]
            return tuple(chunk for chunk in chunks if accepts(chunk))

        @lru_cache(maxsize=None)
        def best(free: Group) -> tuple[Group, ...]:
            if len(free) < group_size:
                return ()
            first, rest, result = free[0], free[1:], ()
            for others in combinations(rest, group_size - 1):
                if accepts((first, *others)):
                    candidate = ((first, *others), *best(tuple(i for i in rest if i not in others)))
                    if len(candidate) > len(result):
                        result = candidate
                        if len(result) == len(free) // group_size:
                            return result  # no packing can do better
            without_first = best(rest)  # the lowest free GPU left out, only when that gives more groups
            return without_first if len(without_first) > len(result) else result

        return best(indices)

    def materialize(self, chosen: GroupSizeOption, options: list[GroupSizeOption]) -> ReplicaPlan:
        """The chosen packing's groups, each with its plan on its real GPU indices."""
        size, share = chosen.group_size, self.cpu_share(chosen.group_size)
        groups = []
        for indices in self.packing(size, chosen.fit):
            found = self.plan({index: self.inventory[index] for index in indices}, share)
            groups.append(ReplicaGroup(replica=len(groups), accelerators=list(indices), fit=replica_fit(found),
                                       plan=found))
        used = {index for group in groups for index in group.accelerators}
        return ReplicaPlan(
            group_size=size, groups=groups, unused=sorted(set(self.inventory) - used), fit=chosen.fit,
            options=options, cpu_share=share,
        )  # fmt: skip
