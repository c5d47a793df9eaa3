"""The Plan's text reports: the verdict's warnings, each device's peak split in the plan's memory vocabulary
(`with_breakdown`, derived from the components so files of any version get it), and `Plan.explain()`'s tables.
`plan_schema` builds the first two into the Plan's derived fields and calls the third.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .cost import STREAM_BUFFER_BLOCKS
from .devices import device_label, is_accelerator
from .sizes import format_bytes
from .cost import copy_bandwidth
from .rates import DISK_BYTES_PER_S, PCIE_BYTES_PER_S
from .time_model import OVERLAP_MODEL, short_name

if TYPE_CHECKING:  # plan_schema imports this module for the Plan's derived fields and reports
    from .plan_records import ComponentPlan, DevicePlan
    from .plan_schema import Plan


# Under this share left, a device is warned about: the activation estimate and the allocator's rounding are each
# good to a few percent.
TIGHT_SHARE = 0.05


def fullest_device(devices: list[DevicePlan]) -> Optional[DevicePlan]:
    """The device whose predicted peak is the largest share of its budget: the accelerators in use first (that
    is the question asked), the host only when no accelerator holds or runs anything."""
    budgeted = [d for d in devices if d.budget]
    candidates = [d for d in budgeted if is_accelerator(d.device) and d.predicted_peak] or [
        d for d in budgeted if d.device == "cpu"]
    return max(candidates, key=lambda d: d.predicted_peak / d.budget, default=None)


def verdict_warnings(components: list[ComponentPlan], devices: list[DevicePlan], *,
                     link_bandwidth: float = PCIE_BYTES_PER_S, link_source: str = "",
                     disk_bandwidth: float = DISK_BYTES_PER_S) -> list[str]:
    """A device over its budget or under 5% left; each component that moves weights per call or executes on the
    CPU, with its cost per call (plans before the transfer model: per run)."""
    notes = []
    for device in devices:
        if not device.budget or not (device.weight_bytes or device.predicted_peak):
            continue
        label = device_label(device.device)
        if device.left is not None and device.left < 0:
            notes.append(f"{label} is over its budget: predicted peak {format_bytes(device.predicted_peak)} of "
                         f"{format_bytes(device.budget)} ({format_bytes(-device.left)} too much).")
        elif device.left is not None and device.left < TIGHT_SHARE * device.budget:
            notes.append(f"{label} is tight: {format_bytes(device.left)} left of {format_bytes(device.budget)} "
                         f"({device.left / device.budget:.1%}, under {TIGHT_SHARE:.0%}); the activation estimate's "
                         "error can exceed that. Give it a larger budget or plan with a smaller call.")
    notes += [note for component in components for note in technique_notes(component)]
    notes += [not_counted_note(component) for component in components if component.activations_not_counted]
    if components and all(c.execution_device == "cpu" for c in components):
        total = format_bytes(sum(c.bytes for c in components))
        return notes + [f"Every component executes on the CPU ({total} of weights at CPU speed, typically 10-100x "
                        "slower than on a GPU)."]
    if any(c.transfer is not None for c in components):
        return notes + transfer_warnings(components, link_bandwidth, link_source, disk_bandwidth)
    slow = [note for component in components if (note := _slow_component(component))]
    if slow:
        slow.append("A cost per run multiplies by the runs per call: a denoiser runs once per denoising step.")
    return notes + slow


_TECHNIQUE_WORDS = {"vae_tiling": "VAE tiling", "vae_slicing": "VAE slicing"}


def not_counted_note(component: ComponentPlan) -> str:
    """What a plan whose call could not be estimated for `component` does not guarantee."""
    return (f"{component.name}: activations NOT counted (weights only): {component.activations_not_counted}. The "
            f"plan does not guarantee that {component.name}'s call fits: its device needs room for its activations "
            f"beyond the predicted peak. Give its peak with placement.plan(activations={{'{component.name}': "
            "<bytes>}), or leave room on its device.")


def technique_notes(component: ComponentPlan) -> list[str]:
    return [f"{component.name}: {_TECHNIQUE_WORDS.get(used.technique.value, used.technique.value)} on "
            f"(the load turns it on): {used.reason}" for used in component.memory_techniques]


def transfer_warnings(components: list[ComponentPlan], bandwidth: float, source: str,
                      disk_bandwidth: float = DISK_BYTES_PER_S) -> list[str]:
    notes = []
    for component in components:
        if component.execution_device == "cpu":
            notes.append(_cpu_note(component))
            continue
        transfer = component.transfer
        if transfer is None or not transfer.bytes_per_call:
            continue
        notes.append(f"{component.name} {_moves(component)}: {format_bytes(transfer.bytes_per_call)} per call, "
                     f"about {_seconds(transfer.bytes_per_call / copy_bandwidth(component.kind, bandwidth, disk_bandwidth))}.")
    moved = sum(c.transfer.bytes_per_call for c in components if c.transfer is not None)
    if moved:
        where = f" ({source})" if source else ""
        notes.append(f"Per call, {format_bytes(moved)} cross from host memory to the accelerators, about "
                     f"{_seconds(moved / bandwidth)} at {bandwidth / 1e9:g} GB/s{where}; prefetching overlaps part "
                     "of it with compute.")
    return notes


def _moves(component: ComponentPlan) -> str:
    """"keeps 9.24 GiB resident on GPU 0, loads 0.79 GiB per call and streams 12.92 GiB at each of its 28 runs"."""
    transfer = component.transfer
    runs_on = device_label(component.execution_device)
    parts = [f"keeps {format_bytes(transfer.resident_bytes)} resident"] if transfer.resident_bytes else []
    source = "disk" if component.kind.value == "disk" else "CPU RAM"
    if transfer.loaded_per_call_bytes:
        parts.append(f"loads {format_bytes(transfer.loaded_per_call_bytes)} from {source} to {runs_on} per call")
    if transfer.streamed_per_run_bytes:
        each = f"each of its {transfer.runs_per_call} runs" if transfer.runs_per_call > 1 else "its one run"
        parts.append(f"streams {format_bytes(transfer.streamed_per_run_bytes)} from {source} to {runs_on} at {each}")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _cpu_note(component: ComponentPlan) -> str:
    return (f"{component.name} executes on the CPU: {format_bytes(component.bytes)} of weights computed at CPU speed "
            "on every run, typically 10-100x slower than on a GPU.")


def _slow_component(component: ComponentPlan) -> Optional[str]:
    size = format_bytes(component.bytes)
    runs_on = device_label(component.execution_device)
    if component.execution_device == "cpu":
        return _cpu_note(component)
    if component.kind.value == "offloaded":
        seconds = component.bytes / PCIE_BYTES_PER_S
        return (f"{component.name} is offloaded: {size} move from CPU RAM to {runs_on} on every run, "
                f"about {seconds * 1000:.0f} ms at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s.")
    if component.kind.value == "disk":
        seconds = component.bytes / DISK_BYTES_PER_S
        return (f"{component.name} is served from disk: {size} read and moved to {runs_on} on every run, "
                f"about {seconds * 1000:.0f} ms at {DISK_BYTES_PER_S / 1e9:.0f} GB/s.")
    return None


_STREAMED_KINDS = ("offloaded", "disk")


def with_breakdown(device: DevicePlan, plan: Plan) -> DevicePlan:
    """`device` with `activations`, `streaming_working_set` and `loaded_per_call` filled from its peak phase (files
    before v3 have no phases: the largest transient is taken)."""
    parts = {name: _parts(component, device.device, device.phases.get(name)) for name, component in
             plan.components.items()}
    peak = device.peak_phase
    chosen = parts.get(peak) if peak is not None else None
    if chosen is None:
        chosen = max(parts.values(), default=(0, 0, 0, 0))
    total, activation, streamed, loaded = chosen
    if total != device.activation_peak:  # pinned or hand-made plans: keep the sum exact, streaming first
        streamed = min(streamed, device.activation_peak)
        activation = device.activation_peak - streamed
        loaded = min(loaded, streamed)
    return device.model_copy(update={
        "activations": activation if plan.activations_accounted else None,
        "streaming_working_set": streamed,
        "loaded_per_call": loaded,
    })


def _parts(component: ComponentPlan, device, phase: int | None) -> tuple[int, int, int, int]:
    """(phase bytes, activations, streaming working set, loaded per call) of `component`'s phase on `device`:
    executing here, its activations and streaming working set; spanning it while executing elsewhere, its
    activations; loading blocks here per call (`per_call_devices`) or streaming them onto it (`streamed_devices`,
    pooled residency), its activations, those blocks and its stream buffer."""
    activation = component.activation_bytes or 0
    transfer = component.transfer
    away = () if transfer is None else {*transfer.per_call_devices.values(), *transfer.streamed_devices.values()}
    if device != component.execution_device and device in away:
        working = max((phase or 0) - activation, 0)  # what it loads here per call and the blocks in flight here
        streams_here = device in transfer.streamed_devices.values()
        # Less the blocks in flight here when it streams here (its streamed blocks taken as equal in size).
        flight = STREAM_BUFFER_BLOCKS * transfer.streamed_per_run_bytes // max(len(transfer.streamed_modules), 1)
        loaded = max(working - flight, 0) if streams_here else working
        return activation + working, activation, working, loaded
    if component.execution_device == device:
        streamed = component.streamed_unit_bytes if component.kind.value in _STREAMED_KINDS else 0
        # What loads per call HERE: the working set less the blocks in flight (blocks it loads per call onto
        # another accelerator, `per_call_devices`, are that device's); at most what it loads per call in all.
        loaded = (min(transfer.loaded_per_call_bytes, max(streamed - transfer.stream_buffer_bytes, 0))
                  if transfer is not None and streamed else 0)
        return activation + streamed, activation, streamed, loaded
    if is_accelerator(device) and device in component.placed_bytes and component.kind.value != "whole":
        return activation, activation, 0, 0
    return 0, 0, 0, 0


EMPTY = "."


def explain_plan(plan: Plan) -> str:
    """The verdict, a components x devices table, the device, transfer and time tables, then the reasons."""
    lines = [*verdict_lines(plan), *simulated_lines(plan), "", f"Placement plan (strategy {plan.strategy!r})", ""]
    lines += [*_component_table(plan), "", *_device_table(plan), *transfer_lines(plan), *time_lines(plan), "",
              _activation_note(plan), *budget_source_lines(plan)]
    edges = ", ".join(f"{a} -> {b}" for a, b in plan.crossing_edges) or "none"
    lines.append(f"Edges crossing devices: {edges}")
    if plan.map_reasons or plan.left_empty:
        lines += ["", "Why this map:", *[f"  {reason}" for reason in [*plan.map_reasons, *plan.left_empty.values()]]]
    if plan.fallbacks:
        lines += ["", *fallback_lines(plan)]
    said = [*plan.warnings, *plan.advise()]  # the advice is worked out now, when a person reads the plan
    if said:
        lines += ["", "Warnings:", *[f"  {warning}" for warning in said]]
    return "\n".join(lines)


def _component_table(plan: Plan) -> list[str]:
    devices = [entry.device for entry in plan.devices]
    # With a call spec, each component's own activation peak: which one sets a device's "activations" below.
    activations = ["activations"] if plan.activations_accounted else []
    header = ["component", "kind", "dtype", "runs on", *activations, *[device_label(d) for d in devices]]
    rows = []
    for name, component in plan.components.items():
        cells = [format_bytes(component.placed_bytes[d]) if d in component.placed_bytes else EMPTY for d in devices]
        kind = component.kind.value + (" (pinned)" if component.pinned else "")
        own = [EMPTY if component.activation_bytes is None else "not counted" if component.activations_not_counted
               else format_bytes(component.activation_bytes)]
        dtype = component.dtype or "as built"  # plans saved before every component stated its dtype
        rows.append([name, kind, dtype, device_label(component.execution_device), *own[: len(activations)], *cells])
    totals = [format_bytes(entry.weight_bytes) for entry in plan.devices]
    rows.append(["total weights", "", "", "", *[""] * len(activations), *totals])
    return aligned_columns(header, rows, left=4)


def _device_table(plan: Plan) -> list[str]:
    # "activations" only when a call was planned for: otherwise the transient is the streaming working set alone.
    activations = ["activations"] if plan.activations_accounted else []
    header = ["device", "budget", "weights", *activations, "streaming working set", "(loaded per call)",
              "runtime overhead", "predicted peak", "left", "peak while"]
    rows = []
    for entry in plan.devices:
        budget = "unlimited" if entry.budget is None else format_bytes(entry.budget)
        budget += " (detected)" if entry.detected else ""
        own = [format_bytes(entry.activations or 0)][: len(activations)]
        sizes = (entry.streaming_working_set, entry.loaded_per_call, entry.overhead, entry.predicted_peak)
        rows.append([device_label(entry.device), budget, format_bytes(entry.weight_bytes), *own,
                     *map(format_bytes, sizes), EMPTY if entry.left is None else format_bytes(entry.left),
                     entry.peak_phase or EMPTY])
    return aligned_columns(header, rows, left=1)


def transfer_lines(plan: Plan) -> list[str]:
    if plan.transfer_bytes_per_call is None:
        return []  # a plan written before the transfer model
    if plan.transfer_bytes_per_call == 0:  # a table of zeros says less than one line
        return ["", "Moved per call: nothing (every weight the accelerators use stays resident across calls)."]
    speed = f"{plan.link_bandwidth / 1e9:g} GB/s, {plan.link_bandwidth_source}"
    title = f"Moved per call, host -> accelerator, steady state (time at {speed}):"
    header = ["component", "runs", "resident", "loaded per call", "streamed per run", "per call", "time"]
    moving = [(name, c.transfer) for name, c in plan.components.items() if c.transfer is not None]
    rows = [[name, str(t.runs_per_call), *map(format_bytes, (t.resident_bytes, t.loaded_per_call_bytes,
                                                             t.streamed_per_run_bytes, t.bytes_per_call)),
             format_seconds(t.bytes_per_call / plan.link_bandwidth)] for name, t in moving]
    rows.append(["total", "", "", "", "", format_bytes(plan.transfer_bytes_per_call),
                 format_seconds(plan.transfer_seconds_per_call)])
    return ["", title, *aligned_columns(header, rows, left=1)]


def format_seconds(seconds: float) -> str:
    """Milliseconds under a second, else seconds to the hundredth (the tables' and the drawing's unit)."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def verdict_lines(plan: Plan) -> list[str]:
    verdict = plan.verdict
    said = [line for line in (verdict.time, verdict.host_memory) if line is not None]
    return [verdict.headline, *said, *[f"  ! {warning}" for warning in verdict.warnings]]


def time_lines(plan: Plan) -> list[str]:
    """Predicted compute, copies and exposed copies per call (`time_model`); nothing without FLOPs."""
    if plan.seconds_per_call is None:
        return []
    time = plan.time_per_call()
    gpu = time.gpu
    title = (f"Predicted time per call on {short_name(gpu)} ({plan.gpu_source}; {gpu.bf16_tflops:g} bf16 / "
             f"{gpu.fp32_tflops:g} fp32 TFLOPS, {gpu.memory_gb_s:g} GB/s memory, at the efficiencies of "
             f"placement.gpu_profiles, {gpu.efficiency_source}; {OVERLAP_MODEL}):")
    header = ["component", "runs", "compute", "copies", "exposed", "total"]
    rows = [[c.name, str(c.runs),
             "?" if c.compute_s is None else format_seconds(c.compute_s) + (" (CPU)" if c.on_cpu else ""),
             *map(format_seconds, (c.copy_s, c.exposed_s, c.total_s))] for c in time.components]
    rows.append(["total", "", *map(format_seconds, (time.compute_s, time.copy_s, time.exposed_s, time.seconds))])
    return ["", title, *aligned_columns(header, rows, left=1)]


def simulated_lines(plan: Plan) -> list[str]:
    simulated = plan.simulated_accelerators
    if not simulated:
        return []
    present = plan.inputs.accelerators_present
    has = f"it has {present}" if present else "it has none"
    names = " and ".join(device_label(d) for d in simulated)
    return [f"Simulated: planned for {names}, which the machine that planned it does not have ({has}); this is where "
            "the pipeline would go on such a machine."]


def fallback_lines(plan: Plan) -> list[str]:
    """The fallbacks in the order the strategy placed the components: a reason's "left" is what the device had
    when that component was placed, so only components placed later can have changed it since."""
    order = {name: i for i, name in enumerate(plan.placement_order or plan.components)}
    fallbacks = sorted(plan.fallbacks, key=lambda fb: order.get(fb.component, len(order)))
    lines = ["Fallbacks:"]
    lines += [f"  {fb.component} -> {fb.kind.value}{' (demoted)' if fb.demoted else ''}: {fb.reason}"
              for fb in fallbacks]
    return lines + ["  (in placement order; a reason's 'left' is the device's left when that component was placed)"]


def budget_source_lines(plan: Plan) -> list[str]:
    sources = ", ".join(f"{device_label(d.device)} {d.budget_source}" for d in plan.devices)
    margin = f" The {plan.budget_margin}." if plan.budget_margin else ""
    return [f"Budgets: {sources}.{margin}"]


def _activation_note(plan: Plan) -> str:
    if plan.activations_accounted:
        return (
            "Activations accounted for: predicted peak = weights + activations + streaming working set (of the "
            "component with the largest transient executing there) + runtime overhead (accelerators in use)."
        )
    return (
        "Activations NOT accounted for (no call spec given): predicted peak = weights + streaming working set "
        "only; a large input can still run out of memory. Pass activations= (or call=) to plan for the call."
    )


def aligned_columns(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int) -> list[str]:
    """Columns padded to their widest cell; the first `left` columns left-aligned, numbers right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(
            str(cell).ljust(width) if i < left else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), *[line(row) for row in rows]]
