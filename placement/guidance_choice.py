"""Whether each denoiser's guidance branches run on two GPUs at once (`guidance.GuidanceParallel`), decided on the
finished plan: where the denoiser is whole on one GPU and another GPU has room for a second copy beside what it
already holds in every phase, the predicted seconds decide (`guidance_parallel=None`), or the user did (`True`:
wherever it applies; `False`: never). The second copy's weights and activations and the gathered outputs are
charged to the devices' peaks; each record says what the other option would cost."""

from __future__ import annotations

from typing import Mapping, Optional

from .devices import device_label, is_accelerator
from .errors import PlanError
from .gpu_profiles import PROFILES, DEFAULT_GPU
from .guidance import GuidanceCall, GuidanceMode, GuidanceParallel
from .memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from .plan_schema import ComponentPlan, DevicePlan, PlacementKind, Plan
from .sizes import format_bytes
from .time_model import component_time, guidance_parallel_seconds, seconds_text

GUIDANCE_PARALLEL_CHOICES = (None, True, False)


def check_guidance_parallel(value) -> Optional[bool]:
    """`guidance_parallel=` as given: None (the planner decides), True or False; anything else is refused."""
    if value is None or isinstance(value, bool):
        return value
    raise PlanError(f"guidance_parallel={value!r}: give None (the planner decides by predicted seconds), True (run "
                    "guidance branches on two GPUs wherever that applies) or False (never).")


def choose_guidance_parallel(plan: Plan, guidance: Optional[Mapping[str, GuidanceCall]],
                             requested: Optional[bool]) -> Plan:
    """`plan` with a `guidance_parallel` record per component of `guidance` (as call capture learned it), the
    devices charged for each replica applied. Without `guidance` (no call captured) the plan is returned as it is,
    with a warning where `requested` is True."""
    if not guidance:
        if requested:
            note = ("guidance_parallel=True: not applied, the call's guidance is not known (no call of a diffusers "
                    "pipeline was captured for this plan); plan a pipeline, or give call=.")
            return plan.model_copy(update={"warnings": [*plan.warnings, note]})
        return plan
    records: list[GuidanceParallel] = []
    for name in plan.components:
        if name in guidance:
            record, plan = _decide(plan, plan.components[name], guidance[name], requested)
            records.append(record)
    return plan.model_copy(update={"guidance_parallel": records})


def _decide(plan: Plan, component: ComponentPlan, call: GuidanceCall,
            requested: Optional[bool]) -> tuple[GuidanceParallel, Plan]:
    base = dict(component=component.name, mode=call.mode)
    if call.mode is GuidanceMode.NONE:
        return GuidanceParallel(**base, applied=False, reason=f"{call.seen}: guidance distilled or off, there is no "
                                "second branch to run beside it"), plan
    peer = _peer_bytes(component, call)
    one_gpu, parallel = _seconds(plan, component, call, peer)
    timing = dict(seconds_one_gpu=one_gpu, seconds_parallel=parallel, peer_bytes_per_call=peer)
    unfit = _why_not_whole(component)
    if unfit:
        return GuidanceParallel(**base, **timing, applied=False, reason=unfit), plan
    replica = _replica_device(plan, component, call)
    if isinstance(replica, str):
        return GuidanceParallel(**base, **timing, applied=False, reason=replica), plan
    memory = dict(devices=[component.execution_device, replica], replica_bytes=component.bytes,
                  replica_activation_bytes=_replica_activation(component, call), gather_bytes=_gather(call))
    options = _options(memory["devices"], one_gpu, parallel)
    if requested is False:
        return GuidanceParallel(**base, **timing, **memory, options=options, applied=False,
                                reason=f"turned off (guidance_parallel=False); {call.seen}"), plan
    if requested is None and (parallel is None or one_gpu is None):
        return GuidanceParallel(**base, **timing, **memory, applied=False, reason=(
            f"{call.seen}, but its compute is not known (planned without call=), so no gain can be predicted; "
            "give call=, or guidance_parallel=True")), plan
    if requested is None and parallel >= one_gpu:
        return GuidanceParallel(**base, **timing, **memory, options=options, applied=False, reason=(
            f"{call.seen}, but in parallel it is predicted slower ({seconds_text(parallel)} against "
            f"{seconds_text(one_gpu)} on one GPU: the copies between the GPUs cost more than half its compute)")), \
            plan
    why = "guidance_parallel=True" if requested else "predicted faster"
    record = GuidanceParallel(**base, **timing, **memory, options=options, applied=True, reason=f"{call.seen}; {why}")
    return record, _charged(plan, record)


def _why_not_whole(component: ComponentPlan) -> str:
    if component.kind is PlacementKind.WHOLE and is_accelerator(component.execution_device):
        return ""
    where = "runs on the CPU" if component.execution_device == "cpu" else \
        f"is placed {component.kind.value} ({component.devices})"
    return (f"it {where}; guidance branches run in parallel only where the denoiser is whole on one GPU "
            "and a second GPU holds a copy (pooled residency over GPUs is the option for a denoiser that fits none)")


def _replica_device(plan: Plan, component: ComponentPlan, call: GuidanceCall) -> int | str:
    """The other accelerator with the most room left that holds a second copy beside everything else in every
    phase, and whose execution device has room for the gathered outputs; else why none does."""
    needed = component.bytes + _replica_activation(component, call)
    others = [device for device in plan.devices if is_accelerator(device.device)
              and device.device != component.execution_device]
    if not others:
        return f"the plan has one accelerator (GPU {component.execution_device}); a second branch needs a second GPU"
    roomy = [device for device in others if _room(device) >= needed + _overhead_if_unused(device, plan)]
    home = plan.device(component.execution_device)
    if _room(home) < _gather(call):
        return (f"{device_label(home.device)} has {format_bytes(_room(home))} left, less than the "
                f"{format_bytes(_gather(call))} the replica's outputs take when gathered there")
    if not roomy:
        best = max(others, key=_room)
        overhead = _overhead_if_unused(best, plan)
        extra = f", {format_bytes(overhead)} of runtime overhead on a GPU not used yet" if overhead else ""
        return (f"a second copy needs {format_bytes(needed + overhead)} ({format_bytes(component.bytes)} of "
                f"weights, {format_bytes(needed - component.bytes)} of activations{extra}) on another GPU; the most "
                f"left is {format_bytes(max(_room(best), 0))} on {device_label(best.device)}")
    return max(roomy, key=_room).device


def _room(device: DevicePlan) -> int:
    return device.left if device.left is not None else 1 << 62


def _overhead_if_unused(device: DevicePlan, plan: Plan) -> int:
    """A GPU the plan leaves empty pays the runtime's overhead once it runs the replica (with a call planned)."""
    return ACCELERATOR_RUNTIME_OVERHEAD if plan.activations_accounted and not device.overhead else 0


def _replica_activation(component: ComponentPlan, call: GuidanceCall) -> int:
    """The replica runs half of a batch of two (about half the activations), or one whole call of two."""
    activation = component.activation_bytes or 0
    return -(-activation // 2) if call.mode is GuidanceMode.BATCH_OF_TWO else activation


def _gather(call: GuidanceCall) -> int:
    """The replica's outputs on the execution device: half of a batch of two's, or one call's."""
    return call.output_bytes // call.branches_per_run


def _peer_bytes(component: ComponentPlan, call: GuidanceCall) -> int:
    """Bytes between the GPUs per call: the replica's inputs in and outputs out, at each run (a batch of two: half
    of each run's; two calls: one of each pair's)."""
    runs = 1 if component.transfer is None else component.transfer.runs_per_call
    per_run = call.input_bytes + call.output_bytes
    if call.mode is GuidanceMode.BATCH_OF_TWO:
        return runs * per_run // 2
    return runs // 2 * per_run


def _seconds(plan: Plan, component: ComponentPlan, call: GuidanceCall,
             peer: int) -> tuple[Optional[float], Optional[float]]:
    """The component's compute seconds per call on one GPU and with its branches in parallel (None: not known)."""
    gpu = plan.gpu or PROFILES[DEFAULT_GPU]
    one = component_time(component, gpu, plan.link_bandwidth, plan.disk_read_bandwidth).compute_s
    probe = GuidanceParallel(component=component.name, mode=call.mode, applied=True, reason="",
                             peer_bytes_per_call=peer)
    return one, guidance_parallel_seconds(component, probe, gpu, plan.link_bandwidth)


def _options(devices: list, one_gpu: Optional[float], parallel: Optional[float]) -> list[str]:
    if one_gpu is None or parallel is None:
        return []
    return [f"guidance in parallel on GPUs {devices[0]} and {devices[1]}: {seconds_text(parallel)} per call",
            f"one GPU ({device_label(devices[0])}): {seconds_text(one_gpu)} per call"]


def _charged(plan: Plan, record: GuidanceParallel) -> Plan:
    """The plan with the replica's weights and activations on its GPU and the gathered outputs on the execution
    device, each device's peak and room recomputed."""
    home, replica = record.devices
    devices = []
    for device in plan.devices:
        if device.device == replica:
            overhead = device.overhead or (ACCELERATOR_RUNTIME_OVERHEAD if plan.activations_accounted else 0)
            device = _recomputed(device, weights=device.weight_bytes + record.replica_bytes, overhead=overhead,
                                 phase=(record.component, record.replica_activation_bytes))
        elif device.device == home:
            phase = device.phases.get(record.component, 0) + record.gather_bytes
            device = _recomputed(device, weights=device.weight_bytes, overhead=device.overhead,
                                 phase=(record.component, phase))
        devices.append(device)
    return plan.model_copy(update={"devices": devices})


def _recomputed(device: DevicePlan, *, weights: int, overhead: int, phase: tuple[str, int]) -> DevicePlan:
    phases = {**device.phases, phase[0]: max(device.phases.get(phase[0], 0), phase[1])}
    activation = max([device.activation_peak, *phases.values()])
    peak = weights + activation + overhead
    return device.model_copy(update={"weight_bytes": weights, "overhead": overhead, "phases": phases,
                                     "activation_peak": activation, "predicted_peak": peak,
                                     "left": None if device.budget is None else device.budget - peak})


__all__ = ["GUIDANCE_PARALLEL_CHOICES", "check_guidance_parallel", "choose_guidance_parallel"]
