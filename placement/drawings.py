"""The Plan as pictures: `Plan.to_svg()` (plain SVG, no plotting dependency) and the predicted call as a Chrome
trace (`Plan.timeline()`), in the format the runtime's `hooks.trace_calls()` records a real call in, so a
measured call and a predicted one open side by side in Perfetto.

The timeline replays the plan with the time model's rates and overlap rules, the way `hooks.residency` moves
weights: per-call modules copied one after another at the phase's start (the first run waits for them), streamed
blocks copied one at a time, each issued when the block before it starts computing; a unit computes its share
of the run by bytes once the unit before it is done and its copy has arrived.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence
from xml.sax.saxutils import escape

from .devices import Device, device_label
from .gpu_profiles import DEFAULT_GPU, PROFILES, GpuProfile
from .reports import format_seconds, simulated_lines
from .sizes import format_bytes
from .cost import copy_bandwidth
from .time_model import run_seconds

if TYPE_CHECKING:  # plan_schema imports this module for Plan.to_svg() and Plan.timeline()
    from .plan_records import ComponentPlan
    from .plan_schema import Plan

WIDTH = 960
MARGIN = 20
LABEL_WIDTH = 150  # device names and budgets, left of the bars
BAR_HEIGHT = 28
ROW_HEIGHT = 70  # bar + its legend line + spacing
BOX_WIDTH, BOX_HEIGHT, BOX_GAP = 150, 44, 30
# Colour-blind-safe palette (Okabe-Ito) for components; fixed colours for the memory kinds.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999"]
KIND_COLOURS = {"activations": "#F4A6A6", "streaming working set": "#F9D08B", "runtime overhead": "#B8B8B8"}
LEFT_COLOUR = "#FFFFFF"
OVER_COLOUR = "#D00000"
SIMULATED_COLOUR = "#8A4B00"
NOT_COUNTED_COLOUR = "#A00000"
# Said in the picture of a plan made without a call, in words for Python and command-line users alike.
NOT_COUNTED = ("Activations NOT counted (planned without a call): each bar is weights + streaming working set only, "
               "and a large input can still run out of memory. Plan for the call to count them (call= in Python; "
               "--height and --width with placement plan).")


def plan_svg(plan: Plan) -> str:
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(plan.components)}
    parts: list[str] = []
    y = MARGIN
    headline = plan.verdict.headline
    # Too wide for one line: the outcome, then the fullest device under it.
    lines = [headline] if _text_width(headline, 16) < WIDTH - 2 * MARGIN else headline.split("; ", 1)
    for line in lines:
        parts.append(_text(MARGIN, y + 14, line, size=16, weight="bold", clip=WIDTH - 2 * MARGIN))
        y += 22
    y += 2
    if plan.verdict.time is not None:
        parts.append(_text(MARGIN, y + 13, plan.verdict.time, size=13, weight="bold", clip=WIDTH - 2 * MARGIN))
        y += 19
    for warning in plan.verdict.warnings:
        parts.append(_text(MARGIN, y + 12, "! " + warning, size=11, fill="#A00000", clip=WIDTH - 2 * MARGIN))
        y += 16
    for line in _wrapped(" ".join(simulated_lines(plan)), size=12, width=WIDTH - 2 * MARGIN):
        parts.append(_text(MARGIN, y + 13, line, size=12, weight="bold", fill=SIMULATED_COLOUR))
        y += 17
    if not plan.activations_accounted:  # bars of weights alone look like a whole peak: say they are not
        for line in _wrapped(NOT_COUNTED, size=12, width=WIDTH - 2 * MARGIN):
            parts.append(_text(MARGIN, y + 13, line, size=12, weight="bold", fill=NOT_COUNTED_COLOUR))
            y += 17
    y += 10
    title = f"Memory per device (strategy {plan.strategy!r}); each bar is the device's budget"
    parts.append(_text(MARGIN, y + 12, title, size=13, weight="bold"))
    y += 20
    parts += _key(y)
    y += 26
    for device in plan.devices:
        parts += _device_row(device, plan, colours, y)
        y += ROW_HEIGHT
        for line in _wrapped(plan.left_empty.get(device.device, ""), size=11, width=WIDTH - LABEL_WIDTH - 2 * MARGIN):
            parts.append(_text(LABEL_WIDTH + MARGIN, y - ROW_HEIGHT + BAR_HEIGHT + 30, line, size=11, fill="#444"))
            y += 15
    transfer_parts, y = _transfer_rows(plan, colours, y)
    parts += transfer_parts
    parts += _component_row(plan, colours, y)
    height = y + BOX_HEIGHT + 110
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
        f"<title>Placement plan: {escape(plan.verdict.kind.value)}</title>\n"
        f'<rect width="{WIDTH}" height="{height}" fill="#FAFAFA"/>\n{body}\n</svg>\n'
    )


def _segments(device, plan: Plan, colours) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) in bar order: weights per component, then the transient, overhead, left."""
    segments = [(name, component.placed_bytes[device.device], colours[name])
                for name, component in plan.components.items() if component.placed_bytes.get(device.device)]
    if device.activations:
        segments.append(("activations", device.activations, KIND_COLOURS["activations"]))
    if device.streaming_working_set:
        segments.append(("streaming working set", device.streaming_working_set, KIND_COLOURS["streaming working set"]))
    if device.overhead:
        segments.append(("runtime overhead", device.overhead, KIND_COLOURS["runtime overhead"]))
    if device.left is not None and device.left > 0:
        segments.append(("left", device.left, LEFT_COLOUR))
    return segments


def _device_row(device, plan: Plan, colours, y: int) -> list[str]:
    label = device_label(device.device)
    budget = "unlimited" if device.budget is None else format_bytes(device.budget)
    parts = [
        _text(MARGIN, y + 12, label, size=13, weight="bold"),
        _text(MARGIN, y + 27, f"budget {budget}", size=11),
    ]
    segments = _segments(device, plan, colours)
    scale_bytes = max(device.budget or 0, device.predicted_peak, sum(b for _, b, _ in segments), 1)
    bar_width = WIDTH - LABEL_WIDTH - 2 * MARGIN
    x0 = LABEL_WIDTH + MARGIN
    x = float(x0)
    for name, size, colour in segments:
        width = bar_width * size / scale_bytes
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{BAR_HEIGHT}" fill="{colour}" '
                     f'stroke="#555" stroke-width="0.5"><title>{escape(name)}: {format_bytes(size)}</title></rect>')
        fitting = (text for text in (f"{name} {format_bytes(size)}", name) if _text_width(text, 10) < width - 8)
        label = next(fitting, None)
        if label:  # too narrow for even the name: the line under the bar and the tooltip carry it
            parts.append(_text(x + 4, y + 18, label, size=10))
        x += width
    if device.budget is not None:
        parts.append(f'<rect x="{x0}" y="{y}" width="{bar_width * device.budget / scale_bytes:.1f}" '
                     f'height="{BAR_HEIGHT}" fill="none" stroke="#000" stroke-width="1.2"/>')
    if device.left is not None and device.left < 0:
        parts.append(_text(x0, y + BAR_HEIGHT + 30, f"over budget by {format_bytes(-device.left)}", size=11,
                           fill=OVER_COLOUR))
    legend = " · ".join(f"{name} {format_bytes(size)}" for name, size, _ in segments)
    legend += f" · predicted peak {format_bytes(device.predicted_peak)}"
    parts.append(_text(x0, y + BAR_HEIGHT + 15, legend, size=10, clip=bar_width))
    return parts


def _transfer_rows(plan: Plan, colours, y: int) -> tuple[list[str], int]:
    total = plan.transfer_bytes_per_call
    if total is None:
        return [], y  # a plan written before the transfer model
    speed = f"{plan.link_bandwidth / 1e9:g} GB/s, {plan.link_bandwidth_source}"
    title = (f"Moved per call, host -> accelerator: {format_bytes(total)}, about "
             f"{format_seconds(plan.transfer_seconds_per_call)} at {speed}")
    parts = [_text(MARGIN, y + 12, title, size=13, weight="bold", clip=WIDTH - 2 * MARGIN)]
    y += 22
    moving = [(name, c.transfer) for name, c in plan.components.items() if c.transfer and c.transfer.bytes_per_call]
    bar_width = WIDTH - LABEL_WIDTH - 2 * MARGIN
    for name, transfer in moving:
        width = max(bar_width * transfer.bytes_per_call / total, 1.0)
        seconds = format_seconds(transfer.bytes_per_call / plan.link_bandwidth)
        detail = (f"{format_bytes(transfer.bytes_per_call)} per call ({seconds}):"
                  f" {format_bytes(transfer.loaded_per_call_bytes)} loaded once + {transfer.runs_per_call} x "
                  f"{format_bytes(transfer.streamed_per_run_bytes)} streamed; "
                  f"{format_bytes(transfer.resident_bytes)} resident")
        parts.append(_text(MARGIN, y + 13, name, size=11, weight="bold", clip=LABEL_WIDTH - 10))
        parts.append(f'<rect x="{LABEL_WIDTH + MARGIN}" y="{y + 2}" width="{width:.1f}" height="14" '
                     f'fill="{colours[name]}"><title>{escape(name)}: {escape(detail)}</title></rect>')
        parts.append(_text(LABEL_WIDTH + MARGIN + 4, y + 30, detail, size=10, clip=bar_width))
        y += 38
    if not moving:
        parts.append(_text(MARGIN, y + 12, "nothing: every component is resident on an accelerator (or computes on "
                           "the CPU)", size=11))
        y += 18
    return parts, y + 12


def _key(y: int) -> list[str]:
    parts, x = [_text(MARGIN, y + 11, "key:", size=11)], MARGIN + 40
    for name, colour in [*KIND_COLOURS.items(), ("left", LEFT_COLOUR)]:
        parts.append(f'<rect x="{x}" y="{y + 1}" width="12" height="12" fill="{colour}" stroke="#555" '
                     'stroke-width="0.5"/>')
        parts.append(_text(x + 16, y + 11, name, size=11))
        x += 24 + int(len(name) * 6.5)
    parts.append(_text(x, y + 11, "(component weights: the component's colour, as in the boxes below)", size=11))
    return parts


def _component_row(plan: Plan, colours, y: int) -> list[str]:
    parts = [_text(MARGIN, y + 12, "Components in execution order (arrows: edges that cross devices)", size=13,
                   weight="bold")]
    y += 24
    centres = {}
    per_row = max(1, (WIDTH - 2 * MARGIN + BOX_GAP) // (BOX_WIDTH + BOX_GAP))
    for index, (name, component) in enumerate(plan.components.items()):
        x = MARGIN + (index % per_row) * (BOX_WIDTH + BOX_GAP)
        top = y + (index // per_row) * (BOX_HEIGHT + BOX_GAP + 20)
        centres[name] = (x + BOX_WIDTH / 2, top)
        parts.append(f'<rect x="{x}" y="{top}" width="{BOX_WIDTH}" height="{BOX_HEIGHT}" rx="6" '
                     f'fill="{colours[name]}" fill-opacity="0.25" stroke="{colours[name]}" stroke-width="2"/>')
        parts.append(_text(x + 8, top + 18, name, size=12, weight="bold", clip=BOX_WIDTH - 12))
        where = f"{component.kind.value}, runs on {device_label(component.execution_device)}"
        parts.append(_text(x + 8, top + 35, where, size=10, clip=BOX_WIDTH - 12))
    parts.append('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                 'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>')
    for producer, consumer in plan.crossing_edges:
        (x1, top1), (x2, top2) = centres[producer], centres[consumer]
        bottom1, bottom2 = top1 + BOX_HEIGHT, top2 + BOX_HEIGHT
        dip = max(bottom1, bottom2) + 14 + 6 * (abs(x2 - x1) // (BOX_WIDTH + BOX_GAP))
        parts.append(f'<path d="M{x1:.0f},{bottom1} C{x1:.0f},{dip} {x2:.0f},{dip} {x2:.0f},{bottom2}" fill="none" '
                     f'stroke="#333" stroke-width="1.5" marker-end="url(#arrow)">'
                     f'<title>{escape(producer)} -&gt; {escape(consumer)}</title></path>')
    return parts


def _wrapped(content: str, *, size: int, width: float) -> list[str]:
    lines: list[str] = []
    for word in content.split():
        if lines and _text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def _text_width(content: str, size: int) -> float:
    """A generous estimate of rendered width in a sans-serif font (about 0.62 em per character)."""
    return len(content) * size * 0.62


def _text(x: float, y: float, content: str, *, size: int, weight: str = "normal", fill: str = "#111",
          clip: float | None = None) -> str:
    too_long = clip and _text_width(content, size) > clip  # squeezed to fit rather than overlap its neighbour
    length = f' textLength="{clip:.0f}" lengthAdjust="spacingAndGlyphs"' if too_long else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-weight="{weight}" fill="{fill}"{length}>'
            f"{escape(content)}</text>")


COPY_ISSUED, COPY_DONE = "copy_issued", "copy_done"
COMPUTE_START, COMPUTE_END = "compute_start", "compute_end"
_TRACKS = {"compute": 0, "copy": 1}


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One thing done in a call: `kind` (the constants above) of `block` ("" is the component's own run) on
    `place` (a plan device), at `time_us` from the start."""

    kind: str
    component: str
    block: str
    place: Device
    time_us: float = 0.0
    nbytes: int = 0


def chrome_trace(events: Sequence[TraceEvent]) -> dict:
    """The events as Chrome trace JSON: per device a process with a compute and a copy track; starts paired with
    their ends (the innermost open one, in order)."""
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
    seen = list(dict.fromkeys(places))
    accelerators = sorted(p for p in seen if isinstance(p, int))
    hosts = [p for p in seen if not isinstance(p, int)]
    top = (accelerators[-1] + 1) if accelerators else 0
    return {**{p: p for p in accelerators}, **{p: top + i for i, p in enumerate(hosts)}}


def _device_name(place: Device) -> str:
    return f"GPU {place}" if isinstance(place, int) else str(place).upper()




@dataclass(frozen=True, kw_only=True)
class _Unit:
    path: str
    nbytes: float
    streamed: bool = False
    per_call: bool = False


def predicted_events(plan: Plan, gpu: Optional[GpuProfile] = None) -> list[TraceEvent]:
    gpu = gpu or plan.gpu or PROFILES[DEFAULT_GPU]
    events: list[TraceEvent] = []
    now = 0.0
    for name in plan.execution_order:
        now = _component_events(plan.components[name], gpu, plan.link_bandwidth, plan.disk_read_bandwidth, now,
                                events)
    return events


def timeline(plan: Plan, gpu: Optional[GpuProfile] = None) -> dict:
    return chrome_trace(predicted_events(plan, gpu))


def _units(component: ComponentPlan) -> list[_Unit]:
    """The device-map entries in order, the modules the transfer lists but the map does not name in their place;
    streamed blocks share `streamed_per_run_bytes`, the others the rest."""
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


def _component_events(component: ComponentPlan, gpu: GpuProfile, link: float, disk: float, now: float,
                      events: list[TraceEvent]) -> float:
    transfer = component.transfer
    runs = transfer.runs_per_call if transfer else 1
    place = component.execution_device
    on_cpu = place == "cpu"
    run_s = run_seconds(component.flops_per_run, component.bytes_touched_per_run, gpu, component.dtype,
                        on_cpu=on_cpu) or 0.0
    speed = copy_bandwidth(component.kind, link, disk)
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


