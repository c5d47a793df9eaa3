"""Traces of a call in Chrome's trace format (`{"traceEvents": [...]}`), as Perfetto and chrome://tracing open.

Two sources write the same format, so a measured call and a predicted one open side by side: the runtime's
`hooks.trace_calls()` (what it did) and `Plan.timeline()` (what the time model says it will do). Both are lists
of `TraceEvent`s -- a copy issued / done, a block's compute started / ended, each at a time, on a device --
and `chrome_trace` pairs them into spans: per device one process with a compute track and a copy track, a
component's run spanning its blocks' compute.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from .devices import Device

COPY_ISSUED, COPY_DONE = "copy_issued", "copy_done"
COMPUTE_START, COMPUTE_END = "compute_start", "compute_end"
_TRACKS = {"compute": 0, "copy": 1}


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One thing done in a call: `kind` (the constants above), of `block` (a module path in `component`; "" is
    the component's own run) on `place` (the plan's spelling of a device), at `time_us` from the start; `nbytes`
    for copies."""

    kind: str
    component: str
    block: str
    place: Device
    time_us: float = 0.0
    nbytes: int = 0


def chrome_trace(events: Sequence[TraceEvent]) -> dict:
    """The events as Chrome trace JSON: starts paired with their ends (the innermost open one, in order)."""
    pids = _process_ids(event.place for event in events)
    spans, open_spans = [], defaultdict(deque)
    for event in events:
        track = "copy" if event.kind in (COPY_ISSUED, COPY_DONE) else "compute"
        key = (track, event.component, event.block, event.place)
        if event.kind in (COPY_ISSUED, COMPUTE_START):
            open_spans[key].append(event)
            continue
        if not open_spans[key]:
            continue  # an end whose start came before the trace began
        start = open_spans[key].popleft() if track == "copy" else open_spans[key].pop()
        spans.append(_span(start, event, track, pids[event.place]))
    metadata = []
    for place, pid in pids.items():
        metadata.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": _device_name(place)}})
        for track, tid in _TRACKS.items():
            metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
    return {"traceEvents": metadata + sorted(spans, key=lambda span: (span["ts"], -span["dur"])),
            "displayTimeUnit": "ms"}


def _span(start: TraceEvent, end: TraceEvent, track: str, pid: int) -> dict:
    name = start.component if not start.block else f"{start.component}.{start.block}" if start.component \
        else start.block
    args = {"component": start.component, "block": start.block}
    if track == "copy":
        name, args["bytes"] = f"copy {name}", start.nbytes
    return {"name": name, "cat": track, "ph": "X", "ts": start.time_us,
            "dur": max(end.time_us - start.time_us, 0.0), "pid": pid, "tid": _TRACKS[track], "args": args}


def _process_ids(places: Iterable[Device]) -> dict[Device, int]:
    """Accelerator k is process k; the host after them."""
    seen = list(dict.fromkeys(places))
    accelerators = sorted(p for p in seen if isinstance(p, int))
    hosts = [p for p in seen if not isinstance(p, int)]
    top = (accelerators[-1] + 1) if accelerators else 0
    return {**{p: p for p in accelerators}, **{p: top + i for i, p in enumerate(hosts)}}


def _device_name(place: Device) -> str:
    return f"GPU {place}" if isinstance(place, int) else str(place).upper()


__all__ = ["COMPUTE_END", "COMPUTE_START", "COPY_DONE", "COPY_ISSUED", "TraceEvent", "chrome_trace"]
