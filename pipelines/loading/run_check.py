"""Every placed run checks its plan: `pipe.placement_report()`.

A pipeline placed with hooks times its first calls per component (`hooks.run_timing`); the report sets the
measured seconds beside the plan's (`placement.plan_check`). Once the calls are timed (the first pays for warm-up,
so the last one is compared), a figure off by more than 20% corrects this machine's profile (the compute
throughput of the device it ran on, or the link speed; machine_profile.py), saved once, and the placement is
re-planned with the corrected profile: the report says whether another placement would now be faster and how to
get it.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from torch import nn

from hooks.run_timing import TIMED_CALLS, RunTiming
from placement.plan_schema import Plan
from placement.errors import PlacementError
from placement.machine_profile import CPU_NAME, MachineProfile, load_profile, present_device_name, save_profile
from placement.plan_check import MeasuredCall, PlanCheck, check_plan
from placement.time_model import seconds_text

from ..errors import CallError

_CHECKS: "weakref.WeakKeyDictionary[Any, RunCheck]" = weakref.WeakKeyDictionary()


@dataclass(kw_only=True)
class RunCheck:
    plan: Plan
    timing: RunTiming
    replan: Optional[Callable[[], Plan]]  # the same request planned again (the corrected profile is read anew)
    saved: Optional[list[str]] = None  # what the check saved and advised, once


def start_run_check(pipe: Any, plan: Plan, *, replan: Optional[Callable[[], Plan]] = None) -> None:
    """Time `pipe`'s placed components' first calls, and give it `placement_report()`."""
    modules = {name: pipe.components[name] for name in plan.components
               if isinstance(pipe.components.get(name), nn.Module)}
    places = {name: plan.components[name].execution_device for name in modules}
    runs = {name: (c.transfer.runs_per_call if c.transfer is not None else 1)
            for name, c in plan.components.items()}
    _CHECKS[pipe] = RunCheck(plan=plan, timing=RunTiming.attach(modules, places, runs), replan=replan)
    pipe.placement_report = types.MethodType(placement_report, pipe)


def is_checked(pipe: Any) -> bool:
    """Whether `pipe`'s current placement times its calls (one made on a single device, "cpu", has no hooks)."""
    check = _CHECKS.get(pipe)
    return check is not None and getattr(pipe, "placement_plan", None) is check.plan


def placement_report(pipe: Any) -> str:
    """Measured vs predicted seconds per component of the pipeline's calls timed so far; the corrections they
    make to this machine's profile, and whether another placement would now be faster."""
    if not is_checked(pipe):
        raise CallError(f"{type(pipe).__name__}.placement_report(): this pipeline is not placed by a plan (load it "
                        "with device_map=..., or place it with pipelines.place) or was reset since; place it, call "
                        "it, then ask again.")
    check, plan = _CHECKS[pipe], pipe.placement_plan
    lines = [plan_line(plan)]
    chosen = _last_calls(check.timing.calls())
    if not chosen:
        return "\n".join(lines + [f"No call timed yet: call the pipeline ({TIMED_CALLS} calls are timed; the first "
                                  "pays for warm-up), then ask again."])
    result = check_plan(plan, chosen, device=present_device_name(
        [c.execution_device for c in plan.components.values()]))
    lines += result.lines()
    steady = result.call_index > 0  # every component that ran has a call after its warm-up one
    if steady and check.saved is None:
        check.saved = save_corrections(plan, result) + advice(check, result)
    if check.saved is not None:
        lines += check.saved
    else:
        lines.append(f"  (the profile is corrected once {TIMED_CALLS} calls are timed: the first pays for warm-up)")
    return "\n".join(lines)


def plan_line(plan: Plan) -> str:
    time = plan.time_per_call() if plan.seconds_per_call is not None else None
    if time is None:
        return "The plan predicts no seconds (it was made without a call=): only the measured ones are shown."
    return f"Plan: {time.summary()} ({plan.gpu_source})."


def _last_calls(calls: Mapping[str, list[MeasuredCall]]) -> dict[str, MeasuredCall]:
    """Per component its last whole call timed (the steady state, once there is more than one)."""
    return {name: found[-1] for name, found in calls.items() if found}


def save_corrections(plan: Plan, result: PlanCheck) -> list[str]:
    """Write `result`'s corrections into this machine's profile (made if absent); the lines that say so."""
    if not result.corrects:
        return []
    if plan.inputs is not None and plan.inputs.gpu is not None:
        return [f"  Not saved: the plan assumed a named GPU (gpu={plan.inputs.gpu!r}), not this machine's profile; "
                "plan without gpu= to use and correct it."]
    try:
        profile = load_profile() or MachineProfile()
    except PlacementError as error:  # an unreadable profile is not overwritten behind the user's back
        return [f"  Not saved: {error}"]
    why = (f"a placed run: compute x{result.compute_scale or 1:.3g}, CPU x{result.cpu_scale or 1:.3g}, link "
           f"{'as before' if result.link is None else f'{result.link / 1e9:.3g} GB/s'}")
    if result.compute_scale is not None or result.link is not None:
        profile = profile.corrected(result.device, compute_scale=result.compute_scale, link=result.link, why=why)
    if result.cpu_scale is not None:
        profile = profile.corrected(CPU_NAME, compute_scale=result.cpu_scale, why=why)
    path = save_profile(profile)
    return [f"  Saved to this machine's profile ({path}); plans made here without gpu= use the correction."]


def advice(check: RunCheck, result: PlanCheck) -> list[str]:
    """Whether the planner now chooses another placement, predicted faster, and how to get it."""
    if not result.corrects:
        return []
    if check.replan is None:
        return ["  To place it with the corrected profile: plan it again (a strategy such as device_map='auto', not "
                "a saved plan, or pipe.reset_device_map() then pipelines.place(pipe, ...)): plans made on this "
                "machine now use the corrected profile."]
    try:
        new = check.replan()
    except PlacementError as error:
        return [f"  Could not re-plan with the corrected profile: {error}"]
    old = check.plan.model_copy(update={"gpu": new.gpu, "gpu_source": new.gpu_source,
                                        "link_bandwidth": new.link_bandwidth})  # this placement, re-priced
    old_s, new_s = old.seconds_per_call, new.seconds_per_call
    if old_s is None or new_s is None:
        return ["  Re-planned with the corrected profile; without a call= it predicts no seconds to compare."]
    same = new.device_map == check.plan.device_map and \
        new.transfer_bytes_per_call == check.plan.transfer_bytes_per_call
    if same:
        return [f"  Re-planned with the corrected profile: the same placement is still the best the planner finds "
                f"(now predicted {seconds_text(new_s)} per call)."]
    if new_s < old_s:
        return [f"  Re-planned with the corrected profile: another placement is predicted faster, "
                f"{seconds_text(new_s)} per call against {seconds_text(old_s)} for this one ({_change(check.plan, new)}"
                "). Load the pipeline again with the same arguments to get it: plans made on this machine now use "
                "the corrected profile."]
    return [f"  Re-planned with the corrected profile: the planner chooses another placement "
            f"({_change(check.plan, new)}), predicted {seconds_text(new_s)} per call against {seconds_text(old_s)} for this one: keep this one."]


def _change(old: Plan, new: Plan) -> str:
    moved = [name for name in new.components if name in old.components and
             new.components[name].device_map != old.components[name].device_map]
    gib = (new.transfer_bytes_per_call or 0) / 2**30
    return (f"{', '.join(moved) or 'no component'} placed otherwise, {gib:.2f} GiB moved per call against "
            f"{(old.transfer_bytes_per_call or 0) / 2**30:.2f} GiB")


__all__ = ["placement_report", "start_run_check"]
