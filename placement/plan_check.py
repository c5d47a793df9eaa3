"""A placed run held to its plan: per component the measured seconds of a call (compute, copies) beside the
predicted ones, and where a figure is off by more than `OFF_BY`, the profile parameter it corrects: the compute
throughput (the time model's efficiency) of the device it ran on, or the host -> device link speed.

The runtime measures (`hooks.run_timing`), this module compares; `pipelines` saves the corrections to this
machine's profile (machine_profile.py) and re-plans with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from .devices import Device, is_accelerator
from .gpu_profiles import DEFAULT_GPU, PROFILES
from .time_model import ComponentTime, component_time, plan_copy_rate, seconds_text, short_name

OFF_BY = 0.2  # a measured figure further than this share from its prediction corrects the profile
# Below these, per-operation overhead (Python, kernel launches), not throughput, decides the seconds: such figures
# are shown but correct nothing (the time model prices throughput).
MIN_COMPUTE_S = 0.01
MIN_COPY_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class MeasuredCall:
    """One component's part of one timed call: its runs' wall seconds on its device, and its host -> device
    copies (issue to done). `blocking`: copies waited for in line (no side stream), so all of them are exposed."""

    component: str
    place: Device
    runs: int
    seconds: float
    copy_seconds: float = 0.0
    copy_bytes: int = 0
    blocking: bool = True
    call_index: int = 0  # 0: the first call, which pays for warm-up (kernels chosen, memory allocated)


@dataclass(frozen=True, kw_only=True)
class Row:
    component: str
    on_accelerator: bool
    predicted: ComponentTime
    measured: MeasuredCall
    measured_compute: float
    measured_exposed: float

    @property
    def ratio(self) -> float:
        return self.measured.seconds / max(self.predicted.total_s, 1e-12)

    @property
    def compute_ratio(self) -> Optional[float]:
        if self.predicted.compute_s is None or self.predicted.compute_s <= 0:
            return None
        return self.measured_compute / self.predicted.compute_s


@dataclass(frozen=True, kw_only=True)
class PlanCheck:
    """The comparison, and the corrections it implies (None: within `OFF_BY`, or nothing to measure it by)."""

    rows: tuple[Row, ...]
    device: str  # the accelerators' name the corrections are for
    compute_scale: Optional[float]  # multiplies the accelerator's compute throughput
    cpu_scale: Optional[float]  # multiplies the CPU's
    link: Optional[float]  # measured host -> device bytes/s
    predicted_link: float
    call_index: int

    @property
    def corrects(self) -> bool:
        return any(value is not None for value in (self.compute_scale, self.cpu_scale, self.link))

    def lines(self) -> list[str]:
        which = "the first (it pays for warm-up)" if self.call_index == 0 else f"call {self.call_index + 1}"
        lines = [f"Measured vs predicted per component, {which} of the calls timed:"]
        width = max((len(row.component) for row in self.rows), default=9)
        for row in self.rows:
            overhead = f"  (predicted under {seconds_text(MIN_COMPUTE_S)}: overhead)"
            flag = "" if abs(row.ratio - 1) <= OFF_BY else "  <- off by more than 20%" if (
                row.predicted.total_s >= MIN_COMPUTE_S) else overhead
            copies = ""
            if row.measured.copy_bytes or row.predicted.copy_s:
                copies = (f"; copies {seconds_text(row.measured.copy_seconds)} (predicted "
                          f"{seconds_text(row.predicted.copy_s)}), exposed {seconds_text(row.measured_exposed)} "
                          f"(predicted {seconds_text(row.predicted.exposed_s)})")
            compute = "" if row.predicted.compute_s is None else (
                f": compute {seconds_text(row.measured_compute)} (predicted {seconds_text(row.predicted.compute_s)})")
            lines.append(f"  {row.component:<{width}}  measured {seconds_text(row.measured.seconds)}, predicted "
                         f"{seconds_text(row.predicted.total_s)} ({row.ratio:.3g}x){compute}{copies}{flag}")
        lines += self.correction_lines()
        return lines

    def correction_lines(self) -> list[str]:
        lines = []
        if self.compute_scale is not None:
            lines.append(f"  Compute on {self.device} ran at {self.compute_scale:.3g}x the speed the plan assumed: "
                         f"this corrects its compute efficiency (throughput x{self.compute_scale:.3g}).")
        if self.cpu_scale is not None:
            lines.append(f"  Compute on the CPU ran at {self.cpu_scale:.3g}x the speed the plan assumed: this "
                         f"corrects the CPU's throughput (x{self.cpu_scale:.3g}).")
        if self.link is not None:
            lines.append(f"  Copies moved {self.link / 1e9:.3g} GB/s, the plan assumed "
                         f"{self.predicted_link / 1e9:.3g} GB/s: this corrects the link speed.")
        if not lines:
            lines.append(f"  Nothing to correct: every figure is within {OFF_BY:.0%} of the plan's, or too small to "
                         f"measure throughput by (compute under {seconds_text(MIN_COMPUTE_S)}, copies under "
                         f"{MIN_COPY_BYTES >> 20} MiB: per-operation overhead decides those).")
        return lines


def check_plan(plan, measured: Mapping[str, MeasuredCall], *, device: Optional[str] = None) -> PlanCheck:
    """`plan` (a placement.Plan) held to `measured` (one call's figures per component)."""
    gpu = plan.gpu or PROFILES[DEFAULT_GPU]
    rows = []
    link = _measured_link(plan, measured)
    for name, call in measured.items():
        component = plan.components.get(name)
        if component is None:
            continue
        predicted = component_time(component, gpu, plan_copy_rate(plan, gpu), plan.disk_read_bandwidth)
        if call.blocking:
            exposed = call.copy_seconds
        else:  # a side stream's copies overlap compute: their exposed part priced at the speed they moved
            exposed = component_time(component, gpu, link or plan.link_bandwidth, plan.disk_read_bandwidth).exposed_s
        rows.append(Row(component=name, on_accelerator=is_accelerator(component.execution_device),
                        predicted=predicted, measured=call, measured_compute=max(call.seconds - exposed, 0.0),
                        measured_exposed=min(exposed, call.seconds)))
    off_link = link is not None and abs(plan.link_bandwidth / link - 1) > OFF_BY
    return PlanCheck(rows=tuple(rows), device=device or short_name(gpu),
                     compute_scale=_scale([r for r in rows if r.on_accelerator]),
                     cpu_scale=_scale([r for r in rows if not r.on_accelerator]),
                     link=link if off_link else None, predicted_link=plan.link_bandwidth,
                     call_index=min((call.call_index for call in measured.values()), default=0))


def _scale(rows: list[Row]) -> Optional[float]:
    """Predicted over measured compute seconds of `rows` together, when further than `OFF_BY` from 1."""
    known = [row for row in rows if row.compute_ratio is not None and row.measured_compute > 0
             and row.predicted.compute_s >= MIN_COMPUTE_S]
    if not known:
        return None
    scale = sum(row.predicted.compute_s for row in known) / sum(row.measured_compute for row in known)
    return scale if abs(1 / scale - 1) > OFF_BY else None


def _measured_link(plan, measured: Mapping[str, MeasuredCall]) -> Optional[float]:
    """Host -> accelerator bytes/s of the timed copies (disk-homed components' aside: the disk paces them)."""
    moved = [call for name, call in measured.items() if call.copy_bytes and call.copy_seconds > 0
             and name in plan.components and plan.components[name].kind != "disk"]
    if sum(call.copy_bytes for call in moved) < MIN_COPY_BYTES:
        return None
    return sum(call.copy_bytes for call in moved) / sum(call.copy_seconds for call in moved)


__all__ = ["MeasuredCall", "OFF_BY", "PlanCheck", "Row", "check_plan"]
