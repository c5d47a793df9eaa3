"""Host memory: the RAM a placement needs, which of it is pinned, and whether the CPU budget holds it.

Counted from the plan's components (docs/design.md, "Seconds, not only bytes"): host-homed weights once (the
runtime's stores take the module's own tensors, not copies); staging for disk-homed weights, the largest
component's streaming working set (components run one after another); pinned, only what moves per call to a CUDA
accelerator, pinned where it rests. Interpreter, libraries and CPU activations come on top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from pydantic import BaseModel, ConfigDict

from .devices import is_accelerator
from .sizes import format_bytes

if TYPE_CHECKING:
    from .plan_records import ComponentPlan, DevicePlan


class HostMemory(BaseModel):
    """The host RAM a plan needs (module doc): `total_bytes` = host-homed weights + staging; `pinned_bytes` of it
    page-locked when the accelerators are CUDA GPUs; `budget` the plan's "cpu" budget (None: unlimited)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_homed_bytes: int
    staging_bytes: int
    pinned_bytes: int
    budget: Optional[int] = None
    budget_detected: bool = False

    @property
    def total_bytes(self) -> int:
        return self.host_homed_bytes + self.staging_bytes

    @property
    def pinned_share(self) -> float:
        """The share of `pinned_bytes` the "cpu" budget lets the runtime page-lock: page-locked RAM can never be
        paged out, so it is what the budget holds beside the host RAM that stays pageable (the rest of the moving
        bytes copy at the pageable rate, `time_model.host_copy_rate`); 1.0 with no budget or nothing to pin."""
        if self.budget is None or not self.pinned_bytes:
            return 1.0
        room = self.budget - (self.total_bytes - self.pinned_bytes)
        return min(1.0, max(0.0, room / self.pinned_bytes))

    @property
    def over_budget(self) -> Optional[int]:
        """Bytes the budget is short of (None: it holds them, or there is none)."""
        if self.budget is None or self.total_bytes <= self.budget:
            return None
        return self.total_bytes - self.budget

    def summary(self) -> str:
        """"Host RAM: 12.4 GiB (weights 12.0 GiB + staging 0.4 GiB), of which 2.1 GiB pinned; budget 60 GiB"."""
        text = (f"Host RAM: {format_bytes(self.total_bytes)} (host-homed weights {format_bytes(self.host_homed_bytes)}"
                f" + disk staging {format_bytes(self.staging_bytes)}), of which {format_bytes(self.pinned_bytes)} "
                "pinned on CUDA (what moves per call)")
        if self.budget is not None:
            text += f"; cpu budget {format_bytes(self.budget)}"
        if self.pinned_share < 1.0:
            text += (f"; the budget page-locks {self.pinned_share:.0%} of what moves, the rest copies at the "
                     "pageable rate")
        return text + "."


def staging_bytes(component: ComponentPlan) -> int:
    """Disk-homed bytes of `component` in host RAM at once while it runs (module doc)."""
    disk = component.placed_bytes.get("disk", 0)
    return min(component.streamed_unit_bytes, disk) if disk else 0


def pinned_bytes(component: ComponentPlan) -> int:
    """Host bytes of `component` that move per call, pinned where CUDA is (module doc)."""
    if not is_accelerator(component.execution_device) or component.transfer is None:
        return staging_bytes(component) if is_accelerator(component.execution_device) else 0
    host_homed = component.placed_bytes.get("cpu", 0)
    moving = component.transfer.loaded_per_call_bytes + component.transfer.streamed_per_run_bytes
    return min(host_homed, moving) + staging_bytes(component)


def host_memory(components: Mapping[str, ComponentPlan], devices: list[DevicePlan]) -> HostMemory:
    """The plan's host RAM (module doc), against its "cpu" budget."""
    cpu = next((device for device in devices if device.device == "cpu"), None)
    staging = max((staging_bytes(c) for c in components.values()), default=0)
    pinned_homed = sum(pinned_bytes(c) - staging_bytes(c) for c in components.values())
    return HostMemory(host_homed_bytes=sum(c.placed_bytes.get("cpu", 0) for c in components.values()),
                      staging_bytes=staging, pinned_bytes=pinned_homed + staging,
                      budget=None if cpu is None else cpu.budget, budget_detected=bool(cpu and cpu.detected))


def budget_note(memory: HostMemory) -> Optional[str]:
    """A warning when the "cpu" budget cannot hold the host RAM the plan needs (None when it can); not a refusal:
    a strategy may stream a component from disk through a smaller RAM budget on purpose."""
    short = memory.over_budget
    if short is None:
        return None
    where = "free RAM when planning" if memory.budget_detected else "given"
    return (f"Host memory is short: the placement needs {format_bytes(memory.total_bytes)} of host RAM (host-homed "
            f"weights {format_bytes(memory.host_homed_bytes)} + disk staging {format_bytes(memory.staging_bytes)}), "
            f"{format_bytes(short)} more than the cpu budget of {format_bytes(memory.budget)} ({where}). Give a "
            "larger max_memory['cpu'] or free RAM, or give the accelerators more room.")


__all__ = ["HostMemory", "budget_note", "host_memory", "pinned_bytes", "staging_bytes"]
