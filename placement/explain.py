"""`Plan.explain()`: an aligned table a person reads at a glance, then the reasons.

    component     kind   dtype                 runs on  GPU 0  GPU 1   CPU
    text_encoder  whole  bfloat16 (requested)  GPU 1        .   9.00     .
    denoiser      split  bfloat16 (requested)  GPU 0    20.00   4.00     .
    ...
    device  budget  weights  activations  overhead  peak   left
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .devices import device_label
from .sizes import format_bytes

if TYPE_CHECKING:  # plan.py imports this module from Plan.explain(); the type is for readers only
    from .plan import Plan

EMPTY = "."


def explain_plan(plan: Plan) -> str:
    lines = [f"Placement plan (strategy {plan.strategy!r})", ""]
    lines += _component_table(plan)
    lines += ["", *_device_table(plan)]
    lines += ["", _activation_note(plan)]
    if plan.budget_margin:
        lines.append(f"Budgets: {plan.budget_margin}.")
    if plan.crossing_edges:
        lines.append("Edges crossing devices: " + ", ".join(f"{a} -> {b}" for a, b in plan.crossing_edges))
    else:
        lines.append("Edges crossing devices: none")
    if plan.map_reasons:
        lines += ["", "Why this map:"]
        lines += [f"  {reason}" for reason in plan.map_reasons]
    if plan.fallbacks:
        lines += ["", "Fallbacks:"]
        lines += [
            f"  {fb.component} -> {fb.kind.value}{' (demoted)' if fb.demoted else ''}: {fb.reason}"
            for fb in plan.fallbacks
        ]
    if plan.warnings:
        lines += ["", "Warnings:"]
        lines += [f"  {warning}" for warning in plan.warnings]
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
    return _aligned(header, rows, left=4)


def _device_table(plan: Plan) -> list[str]:
    header = ["device", "budget", "weights", "activations", "overhead", "predicted peak", "left"]
    rows = []
    for entry in plan.devices:
        budget = "unlimited" if entry.budget is None else format_bytes(entry.budget) + (" (detected)" if entry.detected else "")
        rows.append([
            device_label(entry.device),
            budget,
            format_bytes(entry.weight_bytes),
            format_bytes(entry.activation_peak),
            format_bytes(entry.overhead),
            format_bytes(entry.predicted_peak),
            EMPTY if entry.left is None else format_bytes(entry.left),
        ])
    return _aligned(header, rows, left=1)


def _activation_note(plan: Plan) -> str:
    if plan.activations_accounted:
        return (
            "Activations accounted for: peak = weights + the largest transient among the components executing "
            "there (activations, plus an offloaded one's streaming working set) + runtime overhead on accelerators."
        )
    return (
        "Activations NOT accounted for (no call spec given): peaks are weights (and streamed blocks) only; a "
        "large input can still run out of memory. Pass activations= (or call=) to plan for the call."
    )


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int) -> list[str]:
    """Columns padded to their widest cell; the first `left` columns left-aligned, numbers right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(
            str(cell).ljust(width) if i < left else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), *[line(row) for row in rows]]
