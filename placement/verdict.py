"""The verdict a plan opens with: does the pipeline fit, how tightly, and what runs slowly.

Four outcomes, from best to worst: every component on accelerators; some weights streamed from CPU RAM or
disk (fits with offloading); some component executing on the CPU; a device over its budget (does not fit:
only components passed in already placed can cause it, the strategies raise instead).

The costs quoted for streamed and CPU components are what a user needs to judge them: the bytes that move
from host memory to the execution device per call (`ComponentPlan.transfer`: loaded once per call, plus the
runs times what streams at every run), and the time that takes at the plan's link bandwidth (25 GB/s, PCIe 4.0
x16, unless given); then the total per call. Plans written before the transfer model quote the bytes per run.
With FLOPs known (a plan for a call), the verdict also says the predicted seconds per call (`time_model.time_line`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .devices import device_label, is_accelerator
from .sizes import format_bytes

if TYPE_CHECKING:  # plan_schema.py builds the verdict from its own records; the types are for readers only
    from .plan_schema import ComponentPlan, DevicePlan

# A device with less than this share of its budget left gets a warning: the activation estimates are
# measured to within a few percent, and the caching allocator's rounding is of the same order, so a plan with
# less than 5% to spare may still run out of memory on the real call.
TIGHT_SHARE = 0.05
# Typical sustained host-to-device bandwidth (PCIe 4.0 x16, pinned memory) and NVMe read bandwidth, to turn
# bytes moved per run into a time a user can weigh. Real machines vary by 2x either way; the bytes are exact.
PCIE_BYTES_PER_S = 25e9
DISK_BYTES_PER_S = 3e9


def fullest_device(devices: list[DevicePlan]) -> Optional[DevicePlan]:
    """The device whose predicted peak is the largest share of its budget: the accelerators in use first (that
    is the question asked), the host only when no accelerator holds or runs anything."""
    budgeted = [d for d in devices if d.budget]
    candidates = [d for d in budgeted if is_accelerator(d.device) and d.predicted_peak] or [
        d for d in budgeted if d.device == "cpu"]
    return max(candidates, key=lambda d: d.predicted_peak / d.budget, default=None)


def verdict_warnings(components: list[ComponentPlan], devices: list[DevicePlan], *,
                     link_bandwidth: float = PCIE_BYTES_PER_S, link_source: str = "") -> list[str]:
    """A device with less than 5% of its budget left, over its budget, and each component that moves weights
    per call or executes on the CPU, with what that costs per call (and the total)."""
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
    if components and all(c.execution_device == "cpu" for c in components):
        total = format_bytes(sum(c.bytes for c in components))
        return notes + [f"Every component executes on the CPU ({total} of weights at CPU speed, typically 10-100x "
                        "slower than on a GPU)."]
    if any(c.transfer is not None for c in components):
        return notes + transfer_warnings(components, link_bandwidth, link_source)
    slow = [note for component in components if (note := _slow_component(component))]
    if slow:
        slow.append("A cost per run multiplies by the runs per call: a denoiser runs once per denoising step.")
    return notes + slow


_TECHNIQUE_WORDS = {"vae_tiling": "VAE tiling", "vae_slicing": "VAE slicing"}


def technique_notes(component: ComponentPlan) -> list[str]:
    """One line per memory technique the plan turned on for `component` (the load applies it), with why."""
    return [f"{component.name}: {_TECHNIQUE_WORDS.get(used.technique.value, used.technique.value)} on "
            f"(the load turns it on): {used.reason}" for used in component.memory_techniques]


def transfer_warnings(components: list[ComponentPlan], bandwidth: float, source: str) -> list[str]:
    """Per component that moves weights or computes on the CPU, what and how long per call; then the total."""
    notes = []
    for component in components:
        if component.execution_device == "cpu":
            notes.append(f"{component.name} executes on the CPU: {format_bytes(component.bytes)} of weights computed "
                         "at CPU speed on every run, typically 10-100x slower than on a GPU.")
            continue
        transfer = component.transfer
        if transfer is None or not transfer.bytes_per_call:
            continue
        notes.append(f"{component.name} {_moves(component)}: {format_bytes(transfer.bytes_per_call)} per call, "
                     f"about {_seconds(transfer.bytes_per_call / _bandwidth(component, bandwidth))}.")
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


def _bandwidth(component: ComponentPlan, link: float) -> float:
    return min(link, DISK_BYTES_PER_S) if component.kind.value == "disk" else link


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _slow_component(component: ComponentPlan) -> Optional[str]:
    size = format_bytes(component.bytes)
    runs_on = device_label(component.execution_device)
    if component.execution_device == "cpu":
        return (f"{component.name} executes on the CPU: {size} of weights computed at CPU speed on every run, "
                "typically 10-100x slower than on a GPU.")
    if component.kind.value == "offloaded":
        seconds = component.bytes / PCIE_BYTES_PER_S
        return (f"{component.name} is offloaded: {size} move from CPU RAM to {runs_on} on every run, "
                f"about {seconds * 1000:.0f} ms at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s.")
    if component.kind.value == "disk":
        seconds = component.bytes / DISK_BYTES_PER_S
        return (f"{component.name} is served from disk: {size} read and moved to {runs_on} on every run, "
                f"about {seconds * 1000:.0f} ms at {DISK_BYTES_PER_S / 1e9:.0f} GB/s.")
    return None
