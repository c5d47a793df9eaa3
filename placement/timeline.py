"""The predicted call as a trace: `Plan.timeline()`, in the format `hooks.trace_calls()` records the real one.

Seconds per call (`time_model`) are one number; a timeline shows where they go: per component and run, each
block computing, each copy beside the compute that hides it. It replays the plan with the time model's
rates and its overlap rules, the way the runtime moves things (`hooks.residency`):
- a component's per-call modules are copied when its phase starts (its first run), one after another, and its
  first run waits for them all;
- at every run its streamed blocks are copied one at a time on one copy track: a run's first streamed block
  when the run starts, each later one when the streamed block before it starts computing; a block computes
  once the block before it is done and its own copy has arrived;
- the other units (resident, loaded per call) compute when their turn comes.
The units are the plan's own: the component's device-map entries in execution order, with the modules its
transfer lists but its map does not name (`{"": "cpu"}` offloaded whole) in their place. A unit's compute is
its share of the run's compute by bytes (streamed blocks `streamed_per_run_bytes` shared equally, the others
the rest shared equally), as the time model takes it. Times start at 0 for the first component; components
run one after another in execution order, as `seconds_per_call` adds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .chrome_trace import COMPUTE_END, COMPUTE_START, COPY_DONE, COPY_ISSUED, TraceEvent, chrome_trace
from .gpu_profiles import PROFILES, DEFAULT_GPU, GpuProfile
from .time_model import run_seconds
from .verdict import DISK_BYTES_PER_S

if TYPE_CHECKING:
    from .plan_schema import ComponentPlan, Plan


@dataclass(frozen=True, kw_only=True)
class _Unit:
    path: str
    nbytes: float
    streamed: bool = False
    per_call: bool = False


def predicted_events(plan: Plan, gpu: Optional[GpuProfile] = None) -> list[TraceEvent]:
    """The predicted call's events (module doc), in time order per track."""
    gpu = gpu or plan.gpu or PROFILES[DEFAULT_GPU]
    events: list[TraceEvent] = []
    now = 0.0
    for name in plan.execution_order:
        now = _component_events(plan.components[name], gpu, plan.link_bandwidth, now, events)
    return events


def timeline(plan: Plan, gpu: Optional[GpuProfile] = None) -> dict:
    """The predicted call as Chrome trace JSON (`{"traceEvents": [...]}`), for Perfetto."""
    return chrome_trace(predicted_events(plan, gpu))


def _units(component: ComponentPlan) -> list[_Unit]:
    transfer = component.transfer
    streamed = list(transfer.streamed_modules) if transfer else []
    per_call = list(transfer.per_call_modules) if transfer else []
    listed = [*per_call, *streamed]
    paths: list[str] = []
    for key in component.device_map:
        under = [path for path in listed if key == "" or path == key or path.startswith(f"{key}.")]
        paths.extend(under if under and under != [key] else [key])
    paths.extend(path for path in listed if path not in paths)
    paths = list(dict.fromkeys(paths))
    weight = float(component.bytes)
    streamed_bytes = float(transfer.streamed_per_run_bytes) if transfer else 0.0
    others = max(len(paths) - len(streamed), 1)
    units = []
    for path in paths:
        is_streamed = path in streamed
        share = streamed_bytes / max(len(streamed), 1) if is_streamed else (weight - streamed_bytes) / others
        units.append(_Unit(path=path, nbytes=share, streamed=is_streamed, per_call=path in per_call))
    return units


def _component_events(component: ComponentPlan, gpu: GpuProfile, link: float, now: float,
                      events: list[TraceEvent]) -> float:
    """Append one component's runs from `now` (seconds); return when it ends."""
    transfer = component.transfer
    runs = transfer.runs_per_call if transfer else 1
    place = component.execution_device
    on_cpu = place == "cpu"
    run_s = run_seconds(component.flops_per_run, component.bytes_touched_per_run, gpu, component.dtype,
                        on_cpu=on_cpu) or 0.0
    speed = min(link, DISK_BYTES_PER_S) if component.kind.value == "disk" else link
    units = _units(component)
    weight = max(float(component.bytes), 1.0)

    def event(kind: str, path: str, at: float, nbytes: float = 0) -> None:
        events.append(TraceEvent(kind=kind, component=component.name, block=path, place=place,
                                 time_us=at * 1e6, nbytes=int(nbytes)))

    copy_free = now
    for run in range(runs):
        event(COMPUTE_START, "", now)
        if run == 0 and transfer is not None and not on_cpu:  # per-call loads, at the phase's start
            per_call = [unit for unit in units if unit.per_call]
            share = transfer.loaded_per_call_bytes / max(len(per_call), 1)
            for unit in per_call:
                event(COPY_ISSUED, unit.path, copy_free, share)
                copy_free += share / speed
                event(COPY_DONE, unit.path, copy_free, share)
            now = copy_free
        streamed = [unit for unit in units if unit.streamed] if not on_cpu else []
        arrival = {}
        if streamed:
            arrival[streamed[0].path], copy_free = _copy(event, streamed[0], max(now, copy_free), speed)
        for unit in units:
            start = max(now, arrival.get(unit.path, now))
            if unit.streamed:
                following = streamed.index(unit) + 1
                if following < len(streamed):
                    nxt = streamed[following]
                    arrival[nxt.path], copy_free = _copy(event, nxt, max(start, copy_free), speed)
            now = start + run_s * unit.nbytes / weight
            if unit.path:  # a component placed whole is one unit: its run's span says it all
                event(COMPUTE_START, unit.path, start)
                event(COMPUTE_END, unit.path, now)
        event(COMPUTE_END, "", now)
    return now


def _copy(event, unit: _Unit, start: float, speed: float) -> tuple[float, float]:
    """Record a streamed block's copy from `start`; (its arrival, when the copy track is free) in seconds."""
    event(COPY_ISSUED, unit.path, start, unit.nbytes)
    done = start + unit.nbytes / speed
    event(COPY_DONE, unit.path, done, unit.nbytes)
    return done, done


__all__ = ["predicted_events", "timeline"]
