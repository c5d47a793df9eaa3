"""What a plan's outcome does not say by itself, worked out (never guessed) and said in flag names: how a float32
plan would do in bfloat16, that a CPU budget was detected here rather than given, what GPU budgets would give
on a machine without GPUs, and why a GPU no larger than the runtime overhead holds nothing. A `DoesNotFitError`
carries these lines with it, the likeliest fix first (dtype, budgets, then the disk)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from placement import ACCELERATOR_RUNTIME_OVERHEAD, Plan
from placement.budgets import CPU_MARGIN, DETECTED_CPU_NOTE
from placement.devices import accelerators_present, device_label, is_accelerator
from placement.errors import DoesNotFitError, PlacementError
from placement.plan_schema import PlacementKind, VerdictKind
from placement.sizes import format_bytes
from placement.reports import TIGHT_SHARE

from ..loading.suggestions import BF16_SUGGESTION
from .args import budgets_arg
from .targets import TargetPlanner, resolve_budgets_arg

_RANK = [VerdictKind.FITS, VerdictKind.OFFLOADED, VerdictKind.PARTLY_CPU, VerdictKind.NO_FIT]
_REDUCED = ("bfloat16", "float16")
EXAMPLE_GPUS = "2x24GiB,cpu=64GiB"  # the GPUs a plan on a machine without any is worked out for


@dataclass(frozen=True, kw_only=True)
class Outcome:
    plan: Optional[Plan] = None
    error: Optional[PlacementError] = None

    @property
    def rank(self) -> int:
        """0 fits on accelerators ... 3 does not fit; 4 when planning failed."""
        return len(_RANK) if self.plan is None else _RANK.index(self.plan.verdict.kind)


def plan_with_advice(make_plan: TargetPlanner, *, dtype: Optional[str], max_memory: Optional[Mapping],
                     budgets_example: str, suggest_gpus: bool = False) -> tuple[Plan, list[str]]:
    """`make_plan(torch_dtype=...)` at `dtype` and the advice for its outcome; a planning error is raised again as a
    `DoesNotFitError` carrying the advice. `suggest_gpus`: work out GPU budgets where there are none (not for a
    run, which can only use what is here)."""
    outcome = _attempt(make_plan, dtype)
    lines = advise(outcome, make_plan=make_plan, dtype=dtype, max_memory=max_memory, budgets_example=budgets_example,
                   suggest_gpus=suggest_gpus)
    if outcome.error is not None:
        if not lines:
            raise outcome.error
        raise DoesNotFitError(_fixes_in_order(outcome.error, lines)) from outcome.error
    return outcome.plan, lines


def advise(outcome: Outcome, *, make_plan: TargetPlanner, dtype: Optional[str], max_memory: Optional[Mapping],
           budgets_example: str, suggest_gpus: bool = False) -> list[str]:
    if outcome.error is not None and not isinstance(outcome.error, DoesNotFitError):
        return []  # a bad input (a path, a key): its message is the whole story
    lines = []
    if outcome.rank > 0 and dtype not in _REDUCED and _in_float32(outcome) and not _said_bf16(outcome):
        lines += _bf16_line(outcome, _attempt(make_plan, "bfloat16"))
    if outcome.rank > 0 and suggest_gpus and max_memory is None and not accelerators_present():
        lines += _no_gpu_line(outcome, make_plan, dtype)
    if outcome.rank > 0:
        lines += _detected_cpu_line(outcome, max_memory, budgets_example)
        lines += _overhead_line(outcome)
    return lines


def _fixes_in_order(error: PlacementError, lines: list[str]) -> str:
    """The error's facts, then the worked-out fixes, then the error's own (the disk: the last resort)."""
    said = str(error).replace(f" {DETECTED_CPU_NOTE}", "")  # said again in the lines, in flag names
    problem = getattr(error, "problem", "")
    if not problem or not said.startswith(problem):
        return " ".join([said, *lines])
    own = said[len(problem):].strip()
    return f"{problem} Likeliest fixes first: " + " ".join(
        f"({number}) {line}" for number, line in enumerate([*lines, own], start=1))


def _attempt(make_plan: Callable[..., Plan], dtype: Optional[str]) -> Outcome:
    import torch

    try:
        return Outcome(plan=make_plan(torch_dtype=None if dtype is None else getattr(torch, dtype)))
    except PlacementError as error:
        return Outcome(error=error)


def _said_bf16(outcome: Outcome) -> bool:
    said = [str(outcome.error)] if outcome.plan is None else [*outcome.plan.warnings, *outcome.plan.advise()]
    return any(BF16_SUGGESTION in text for text in said)


def _in_float32(outcome: Outcome) -> bool:
    """The plan sized some component in float32 (an error says nothing of dtypes: assume it would have)."""
    if outcome.plan is None:
        return True
    return any(component.dtype.startswith("float32") for component in outcome.plan.components.values())


def _bf16_line(outcome: Outcome, bf16: Outcome) -> list[str]:
    if bf16.rank >= outcome.rank:
        return []
    verdict = bf16.plan.verdict.headline.removeprefix("Verdict: ")
    return [f"This plan is in float32; in bfloat16 (--dtype bf16, half the bytes) it {verdict}"]


def _no_gpu_line(outcome: Outcome, make_plan: TargetPlanner, dtype: Optional[str]) -> list[str]:
    """No GPU here and no budgets given: what example GPU budgets would give (in bfloat16 for a float32 plan)."""
    reduced = dtype in _REDUCED or not _in_float32(outcome)
    flags = f"{'' if reduced else '--dtype bf16 '}--max-memory {EXAMPLE_GPUS}"
    budgets = resolve_budgets_arg(budgets_arg(EXAMPLE_GPUS), "--max-memory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the example's own plan: only its verdict is said
        other = _attempt(dataclasses.replace(make_plan, max_memory=budgets, notes=[]), dtype if reduced else "bfloat16")
    said = "This machine has no GPU, so this plan is for its CPU alone; to plan for the GPUs you will run on, give "
    if other.plan is None or other.rank >= outcome.rank:
        return [f"{said}their budgets, e.g. --max-memory {EXAMPLE_GPUS}."]
    return [f"{said}their budgets: with {flags} it {other.plan.verdict.headline.removeprefix('Verdict: ')}"]


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

