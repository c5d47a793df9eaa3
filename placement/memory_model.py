"""Predicted peak memory per device, phase by phase, kept up to date while a strategy places components.

While component k runs (its *phase*), a device holds every resident weight placed on it, what k's phase brings
(its activations, the weights it loads for the call, its blocks in flight) and a runtime overhead (accelerators,
only with activations accounted): the peak is `weights + the largest phase + overhead`. A split component charges
its full activation peak to every accelerator it spans: conservative, and it keeps a split off a device whose
leftover room is exactly its weights. Without activations explicit budgets are honoured byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from .budgets import Budgets
from .devices import Device, is_accelerator
from .plan_records import DevicePlan

# Charged once per accelerator in use: the CUDA context with cuBLAS/cuDNN workspaces (300-600 MiB, outside the
# caching allocator) plus the allocator's rounding and fragmentation during a forward (a few hundred MiB).
ACCELERATOR_RUNTIME_OVERHEAD = 1024**3


@dataclass
class DeviceLoad:
    """The running total of one device while a plan is built (mutable: a ledger entry, not a record)."""

    device: Device
    budget: Optional[int]
    detected: bool
    weights: int = 0  # resident: held in every phase
    used: bool = False
    phases: dict[str, int] = field(default_factory=dict)  # component -> bytes its phase brings here
    unnamed: int = 0  # a transient added without naming its phase

    @property
    def transient(self) -> int:
        """The largest phase's bytes: what the device holds beyond its resident weights at its peak."""
        return max(self.unnamed, max(self.phases.values(), default=0))


class Ledger:
    """What every device holds so far, and whether one more component fits (weights + transient)."""

    def __init__(self, budgets: Budgets, *, activations_accounted: bool):
        self.activations_accounted = activations_accounted
        self.loads = {
            device: DeviceLoad(device=device, budget=limit, detected=device in budgets.detected)
            for device, limit in budgets.limits.items()
        }

    def copy(self) -> "Ledger":
        """An independent copy, for a strategy that tries several orders and keeps the best."""
        twin = Ledger.__new__(Ledger)
        twin.activations_accounted = self.activations_accounted
        twin.loads = {device: replace(load, phases=dict(load.phases)) for device, load in self.loads.items()}
        return twin

    @property
    def accelerators(self) -> list[int]:
        return [device for device in self.loads if is_accelerator(device)]

    def has(self, device: Device) -> bool:
        return device in self.loads

    def overhead(self, device: Device, *, used: bool = True) -> int:
        if self.activations_accounted and is_accelerator(device) and used:
            return ACCELERATOR_RUNTIME_OVERHEAD
        return 0

    def peak(self, device: Device, *, weights: int = 0, transient: int = 0) -> int:
        """The device's predicted peak if `weights` more were placed and a component with `transient`
        executed there."""
        load = self.loads[device]
        used = load.used or weights > 0 or transient > 0
        return load.weights + weights + max(load.transient, transient) + self.overhead(device, used=used)

    def room(self, device: Device, *, transient: int = 0) -> Optional[int]:
        """Bytes of weights the device can still take for a component that will run there with `transient`
        (None: unlimited). Placing anything makes the device used, so its overhead counts."""
        load = self.loads[device]
        if load.budget is None:
            return None
        return load.budget - (load.weights + max(load.transient, transient) + self.overhead(device))

    def fits(self, device: Device, *, weights: int, transient: int = 0) -> bool:
        budget = self.loads[device].budget
        return budget is None or self.peak(device, weights=weights, transient=transient) <= budget

    def add(self, device: Device, *, weights: int = 0, transient: int = 0, phase: Optional[str] = None) -> None:
        """`weights` more resident bytes; `transient` bytes while component `phase` runs (its phase grows to it)."""
        load = self.loads[device]
        load.weights += weights
        load.used = True
        if phase is None:
            load.unnamed = max(load.unnamed, transient)
        else:
            load.phases[phase] = max(load.phases.get(phase, 0), transient)

    def set_phase(self, device: Device, phase: str, transient: int) -> None:
        """Component `phase`'s bytes on `device` are now exactly `transient` (the transfer plan settled them)."""
        load = self.loads[device]
        load.phases[phase] = transient
        load.used = True

    def phase_bytes(self, device: Device, *, excluding: str) -> int:
        """The largest phase on `device` other than `excluding`'s (an unnamed transient counts as one)."""
        load = self.loads[device]
        return max([load.unnamed, *(n for name, n in load.phases.items() if name != excluding)])

    def device_plans(self) -> list[DevicePlan]:
        plans = []
        for device, load in self.loads.items():
            if device == "disk" and not load.used and load.budget is None:
                continue  # an unused, unlimited disk says nothing worth a row
            overhead = self.overhead(device, used=load.used)
            peak = load.weights + load.transient + overhead
            plans.append(DevicePlan(
                device=device, budget=load.budget, detected=load.detected, weight_bytes=load.weights,
                activation_peak=load.transient, overhead=overhead, predicted_peak=peak,
                left=None if load.budget is None else load.budget - peak,
                phases={name: n for name, n in load.phases.items() if n}))
        return plans
