"""`Plan.explain()`: an aligned table a person reads at a glance, then the reasons.

    component     kind   dtype                 runs on  GPU 0  GPU 1   CPU
    text_encoder  whole  bfloat16 (requested)  GPU 1        .   9.00     .
    denoiser      split  bfloat16 (requested)  GPU 0    20.00   4.00     .
    ...
    device  budget  weights  activations  streaming working set  (loaded per call)  runtime overhead
            predicted peak  left  peak while
    component  runs  resident  loaded per call  streamed per run  per call  time
    component  runs  compute  copies  exposed  total

It opens with the verdict (and its warnings) and ends with the fallbacks' reasons. Every column of the device
table is one word of the plan's memory vocabulary (see `plan_schema`): the device's resident weights, and the
activations / streaming working set of the phase that sets its peak ("peak while": the component running
then). The transfer table says what crosses from host memory to the accelerators per call, per component and
in total, and the time at the plan's link bandwidth; the time table, with FLOPs known (a plan for a call), the
predicted seconds per call (`time_model`). The reasons use the same words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .devices import device_label
from .sizes import format_bytes

if TYPE_CHECKING:  # plan_schema.py imports this module from Plan.explain(); the type is for readers only
    from .plan_schema import Plan

EMPTY = "."


def explain_plan(plan: Plan) -> str:
    lines = [*verdict_lines(plan), *simulated_lines(plan), "", f"Placement plan (strategy {plan.strategy!r})", ""]
    lines += _component_table(plan)
    lines += ["", *_device_table(plan)]
    lines += transfer_lines(plan)
    lines += time_lines(plan)
    lines += ["", _activation_note(plan)]
    lines += budget_source_lines(plan)
    if plan.crossing_edges:
        lines.append("Edges crossing devices: " + ", ".join(f"{a} -> {b}" for a, b in plan.crossing_edges))
    else:
        lines.append("Edges crossing devices: none")
    if plan.map_reasons or plan.left_empty:
        lines += ["", "Why this map:"]
        lines += [f"  {reason}" for reason in [*plan.map_reasons, *plan.left_empty.values()]]
    if plan.fallbacks:
        lines += ["", *fallback_lines(plan)]
    said = [*plan.warnings, *plan.advise()]  # the advice is worked out now, when a person reads the plan
    if said:
        lines += ["", "Warnings:"]
        lines += [f"  {warning}" for warning in said]
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
        own = [EMPTY if component.activation_bytes is None else format_bytes(component.activation_bytes)]
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
        rows.append([
            device_label(entry.device),
            budget,
            format_bytes(entry.weight_bytes),
            *own,
            format_bytes(entry.streaming_working_set),
            format_bytes(entry.loaded_per_call),
            format_bytes(entry.overhead),
            format_bytes(entry.predicted_peak),
            EMPTY if entry.left is None else format_bytes(entry.left),
            entry.peak_phase or EMPTY,
        ])
    return aligned_columns(header, rows, left=1)


def transfer_lines(plan: Plan) -> list[str]:
    """Per component and in total: what crosses host -> accelerator per call, and how long at the link speed."""
    if plan.transfer_bytes_per_call is None:
        return []  # a plan written before the transfer model
    if plan.transfer_bytes_per_call == 0:  # a table of zeros says less than one line
        return ["", "Moved per call: nothing (every weight the accelerators use stays resident across calls)."]
    speed = f"{plan.link_bandwidth / 1e9:g} GB/s, {plan.link_bandwidth_source}"
    title = f"Moved per call, host -> accelerator, steady state (time at {speed}):"
    header = ["component", "runs", "resident", "loaded per call", "streamed per run", "per call", "time"]
    rows = []
    for name, component in plan.components.items():
        transfer = component.transfer
        if transfer is None:
            continue
        rows.append([name, str(transfer.runs_per_call), format_bytes(transfer.resident_bytes),
                     format_bytes(transfer.loaded_per_call_bytes), format_bytes(transfer.streamed_per_run_bytes),
                     format_bytes(transfer.bytes_per_call), _time(transfer.bytes_per_call / plan.link_bandwidth)])
    rows.append(["total", "", "", "", "", format_bytes(plan.transfer_bytes_per_call),
                 _time(plan.transfer_seconds_per_call)])
    return ["", title, *aligned_columns(header, rows, left=1)]


def _time(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def verdict_lines(plan: Plan) -> list[str]:
    """The verdict's headline, then its warnings (a tight device; a component streamed or on the CPU)."""
    verdict = plan.verdict
    time = [] if verdict.time is None else [verdict.time]
    host = [] if verdict.host_memory is None else [verdict.host_memory]
    return [verdict.headline, *time, *host, *[f"  ! {warning}" for warning in verdict.warnings]]


def time_lines(plan: Plan) -> list[str]:
    """Per component and in total: predicted compute, copies and the copies compute does not hide, per call
    (`time_model`); nothing for a plan without FLOPs (planned without a call)."""
    if plan.seconds_per_call is None:
        return []
    from .time_model import OVERLAP_MODEL, short_name  # it reads plan records

    time = plan.time_per_call()
    title = (f"Predicted time per call on {short_name(time.gpu)} ({plan.gpu_source}; {time.gpu.bf16_tflops:g} bf16 / {time.gpu.fp32_tflops:g} fp32 "
             f"TFLOPS, {time.gpu.memory_gb_s:g} GB/s memory, at the efficiencies of placement.gpu_profiles; "
             f"{OVERLAP_MODEL}):")
    header = ["component", "runs", "compute", "copies", "exposed", "total"]
    rows = [[c.name, str(c.runs), "?" if c.compute_s is None else _time(c.compute_s) + (" (CPU)" if c.on_cpu else ""),
             _time(c.copy_s), _time(c.exposed_s), _time(c.total_s)] for c in time.components]
    rows.append(["total", "", _time(time.compute_s), _time(time.copy_s), _time(time.exposed_s), _time(time.seconds)])
    return ["", title, *aligned_columns(header, rows, left=1)]


def simulated_lines(plan: Plan) -> list[str]:
    """A plan for accelerators the planning machine did not have says so, at the top: what it shows is where
    the pipeline would go there, not what this machine can run."""
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
    """Where each budget came from: given in max_memory, detected (with the margin), or unlimited."""
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
