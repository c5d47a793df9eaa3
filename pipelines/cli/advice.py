"""What a plan's outcome does not say by itself, worked out and said in flag names.

- fp32: a plan made in float32 (the presets are built in it; a configs-only folder is sized in it) that fails,
  offloads or runs on the CPU is planned again in bfloat16; when that does better, the user reads how much
  better (the bf16 verdict) and the flag (`--dtype bf16`). Computed, never guessed.
- a detected CPU budget: GPU budgets given without `cpu=` plan the host RAM of *this* machine; when the plan
  fails or uses the CPU's RAM, the message says that budget was detected here and how to give another.
- the runtime overhead: with a call planned for, each GPU in use keeps 1 GiB (CUDA context, workspaces,
  fragmentation); GPUs whose budgets do not exceed it hold nothing, and the message says that is why.

`Outcome` is one attempt (a plan, or the error that stopped it); `advise` returns the lines to print after
the plan, `AdvisedError` carries them with the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from placement import ACCELERATOR_RUNTIME_OVERHEAD, Plan
from placement.budgets import CPU_MARGIN
from placement.devices import device_label, is_accelerator
from placement.errors import DoesNotFitError, OffloadFolderRequiredError, PlacementError, PlanError
from placement.plan_schema import PlacementKind, VerdictKind
from placement.sizes import format_bytes
from placement.verdict import TIGHT_SHARE

_RANK = [VerdictKind.FITS, VerdictKind.OFFLOADED, VerdictKind.PARTLY_CPU, VerdictKind.NO_FIT]
_REDUCED = ("bfloat16", "float16")
FIT_ERRORS = (DoesNotFitError, OffloadFolderRequiredError)  # the errors of a pipeline too big for the budgets


class AdvisedError(PlanError, ValueError):
    """A planning error with what would help appended (the original error is its __cause__)."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    plan: Optional[Plan] = None
    error: Optional[PlacementError] = None

    @property
    def rank(self) -> int:
        """0 fits on accelerators ... 3 does not fit; 4 when planning failed."""
        return len(_RANK) if self.plan is None else _RANK.index(self.plan.verdict.kind)


def plan_with_advice(make_plan: Callable[..., Plan], *, dtype: Optional[str], max_memory: Optional[Mapping],
                     budgets_example: str) -> tuple[Plan, list[str]]:
    """`make_plan(torch_dtype=...)` at `dtype` (a name or None) and the advice for its outcome; a planning
    error is raised again as an `AdvisedError` when there is advice to add."""
    outcome = _attempt(make_plan, dtype)
    lines = advise(outcome, make_plan=make_plan, dtype=dtype, max_memory=max_memory, budgets_example=budgets_example)
    if outcome.error is not None:
        if not lines:
            raise outcome.error
        raise AdvisedError(" ".join([str(outcome.error), *lines])) from outcome.error
    return outcome.plan, lines


def advise(outcome: Outcome, *, make_plan: Callable[..., Plan], dtype: Optional[str], max_memory: Optional[Mapping],
           budgets_example: str) -> list[str]:
    if outcome.error is not None and not isinstance(outcome.error, FIT_ERRORS):
        return []  # a bad input (a path, a key): its message is the whole story
    lines = []
    if outcome.rank > 0 and dtype not in _REDUCED and _in_float32(outcome):
        lines += _bf16_line(outcome, _attempt(make_plan, "bfloat16"))
    if outcome.rank > 0:
        lines += _detected_cpu_line(outcome, max_memory, budgets_example)
        lines += _overhead_line(outcome)
    return lines


def _attempt(make_plan: Callable[..., Plan], dtype: Optional[str]) -> Outcome:
    import torch

    try:
        return Outcome(plan=make_plan(torch_dtype=None if dtype is None else getattr(torch, dtype)))
    except PlacementError as error:
        return Outcome(error=error)


def _in_float32(outcome: Outcome) -> bool:
    """The plan sized some component in float32 (an error says nothing of dtypes: assume the plan would have)."""
    if outcome.plan is None:
        return True
    return any(component.dtype.startswith("float32") for component in outcome.plan.components.values())


def _bf16_line(outcome: Outcome, bf16: Outcome) -> list[str]:
    if bf16.rank >= outcome.rank:
        return []
    verdict = bf16.plan.verdict.headline.removeprefix("Verdict: ")
    return [f"This plan is in float32; in bfloat16 (--dtype bf16, half the bytes) it {verdict}"]


def _detected_cpu_line(outcome: Outcome, max_memory: Optional[Mapping], budgets_example: str) -> list[str]:
    if not max_memory or "cpu" in max_memory or not any(is_accelerator(device) for device in max_memory):
        return []
    if outcome.plan is not None and not _host_ram_binds(outcome.plan):
        return []
    return [f"The CPU budget was detected on this machine (its available RAM less {CPU_MARGIN:.0%}), not given: "
            f"to plan for another machine, give its RAM too, e.g. --max-memory {budgets_example},cpu=64GiB."]


def _host_ram_binds(plan: Plan) -> bool:
    """Host RAM shaped the plan: something went to disk, or the CPU is left with under 5% of its budget."""
    if any(component.kind is PlacementKind.DISK for component in plan.components.values()):
        return True
    cpu = next((d for d in plan.devices if d.device == "cpu"), None)
    return cpu is not None and cpu.budget is not None and cpu.left is not None and cpu.left < TIGHT_SHARE * cpu.budget


def _overhead_line(outcome: Outcome) -> list[str]:
    plan = outcome.plan
    if plan is None or not plan.activations_accounted:
        return []
    starved = [d for d in plan.devices if is_accelerator(d.device) and d.budget is not None
               and d.budget <= ACCELERATOR_RUNTIME_OVERHEAD and d.weight_bytes == 0]
    if not starved:
        return []
    names = " and ".join(device_label(d.device) for d in starved)
    sizes = sorted({format_bytes(d.budget) for d in starved})
    budgets = f"{sizes[0]}{' each' if len(starved) > 1 else ''}" if len(sizes) == 1 else " and ".join(sizes)
    overhead = format_bytes(ACCELERATOR_RUNTIME_OVERHEAD)
    return [f"{names} hold{'s' if len(starved) == 1 else ''} nothing: with a call planned for, each GPU in use "
            f"keeps {overhead} for its runtime (CUDA context, workspaces, allocator fragmentation), and a budget of "
            f"{budgets} leaves no room beyond it. Give each GPU more than {overhead}."]

