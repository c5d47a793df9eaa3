"""A device's largest phase split into the plan's vocabulary: activations, streaming working set (and the part
of it loaded once per call). Derived from the components, so files written before a field existed get it too.

The phase that sets the device's peak is `DevicePlan.peak_phase` (files before version 3 have no phases: the
component with the largest transient there is taken). Its parts on this device:
- executing here: its activations, and when it has host-homed weights, its streaming working set (what it
  loads for the call plus its blocks in flight: `ComponentPlan.streamed_unit_bytes`), of which
  `transfer.loaded_per_call_bytes` is loaded per call;
- holding resident parts here while executing elsewhere (a split, or resident blocks of an offloaded
  component): its activations (charged to every accelerator it spans, as the memory model does);
- loading blocks per call here while executing elsewhere (`transfer.per_call_devices`): its activations and
  those blocks (streaming working set, all of it loaded per call: the rest of its phase here).
Hand-made or pinned plans whose parts do not add up to the device's transient keep the sum exact, streaming
first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .devices import is_accelerator

if TYPE_CHECKING:  # plan_schema calls this from Plan's validator; the types are for readers only
    from .plan_schema import ComponentPlan, DevicePlan, Plan

_STREAMED_KINDS = ("offloaded", "disk")


def with_breakdown(device: DevicePlan, plan: Plan) -> DevicePlan:
    """`device` with `activations`, `streaming_working_set` and `loaded_per_call` filled from its peak phase."""
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
    """(phase bytes, activations, streaming working set, loaded per call) of `component`'s phase on `device`
    (`phase`: what the plan says that phase brings there, when it says)."""
    activation = component.activation_bytes or 0
    transfer = component.transfer
    if transfer is not None and device != component.execution_device and device in transfer.per_call_devices.values():
        loaded = max((phase or 0) - activation, 0)
        return activation + loaded, activation, loaded, loaded
    if component.execution_device == device:
        streamed = component.streamed_unit_bytes if component.kind.value in _STREAMED_KINDS else 0
        transfer = component.transfer
        loaded = min(transfer.loaded_per_call_bytes, streamed) if transfer is not None and streamed else 0
        return activation + streamed, activation, streamed, loaded
    spans = is_accelerator(device) and device in component.placed_bytes and component.kind.value != "whole"
    if spans:
        return activation, activation, 0, 0
    return 0, 0, 0, 0
