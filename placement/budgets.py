"""Budgets: how many bytes each device may hold, from `max_memory` or detected.

An explicit `max_memory` is used exactly as given (no hidden margin); its int keys are the accelerators the plan
may use, present or not. A missing "cpu" means available RAM (detected), a missing "disk" unlimited. Detected
budgets keep back a margin: ACCELERATOR_MARGIN of free memory (at least MIN_ACCELERATOR_MARGIN) for the caching
allocator's fragmentation and a forward's small temporaries, CPU_MARGIN of RAM for other processes, the Python
heap and the page cache safetensors' memory-mapped reads lean on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from .devices import Device, detect_accelerators, device_label, device_sort_key, is_accelerator, normalize_device
from .errors import InvalidDeviceError, PlanError
from .sizes import format_size, parse_budget

ACCELERATOR_MARGIN = 0.10
MIN_ACCELERATOR_MARGIN = 256 * 1024**2
CPU_MARGIN = 0.20

MARGIN_DESCRIPTION = (
    f"detected budgets keep back {ACCELERATOR_MARGIN:.0%} of each accelerator's free memory "
    f"(at least {format_size(MIN_ACCELERATOR_MARGIN, 'MiB', 0)}) and {CPU_MARGIN:.0%} of available RAM"
)


class ZeroBudgetWarning(UserWarning):
    """A GPU listed in `max_memory` with a budget of 0: nothing can be placed on it."""


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Bytes per device, accelerators by index, then "cpu", then "disk" (None: unlimited)."""

    limits: dict[Device, Optional[int]]
    detected: frozenset = frozenset()

    @property
    def accelerators(self) -> tuple[int, ...]:
        return tuple(d for d in self.limits if is_accelerator(d))

    def limit(self, device: Device) -> Optional[int]:
        return self.limits[device]

    def has(self, device: Device) -> bool:
        return device in self.limits

    def given(self) -> dict[Device, int]:
        """The budgets the caller gave (not detected, not unlimited), for the plan's record of its inputs."""
        return {d: b for d, b in self.limits.items() if d not in self.detected and b is not None}


def resolve_budgets(max_memory: Mapping | None) -> Budgets:
    """The budgets for `max_memory` (see the module docstring); a bad key or size is a typed error."""
    if max_memory is None:
        return detect_budgets()
    if not isinstance(max_memory, Mapping):
        raise PlanError(
            f"max_memory must be a dict such as {{0: '24GiB', 1: '24GiB', 'cpu': '64GiB'}}, got {max_memory!r}."
        )
    limits: dict[Device, Optional[int]] = {}
    typed_zero = []
    for key, value in max_memory.items():
        device = _device_key(key)
        if device in limits:
            raise InvalidDeviceError(
                f"max_memory names device {device!r} twice (key {key!r} is another spelling of it); keep one."
            )
        limits[device] = _size(key, value)
        if limits[device] == 0:
            typed_zero.append(device)
    warn_zero_budgets(typed_zero, stacklevel=3)
    detected = set()
    if "cpu" not in limits:
        limits["cpu"] = apply_cpu_margin(_available_ram())
        detected.add("cpu")
    limits.setdefault("disk", None)
    return Budgets(limits=_ordered(limits), detected=frozenset(detected))


DETECTED_CPU_NOTE = (
    f"The CPU budget was detected on this machine (its available RAM less {CPU_MARGIN:.0%}), not given: to plan "
    "for another machine, give its RAM too (max_memory['cpu'], e.g. '64GiB')."
)


def with_detected_cpu_note(error: Exception, budgets: Budgets) -> Exception:
    """`error` (a plan that does not fit) with `DETECTED_CPU_NOTE` appended when GPU budgets were given and the
    CPU's was detected here: planning for a server from a laptop reads the laptop's RAM, and only this says so."""
    given_gpus = any(device not in budgets.detected for device in budgets.accelerators)
    if given_gpus and "cpu" in budgets.detected and DETECTED_CPU_NOTE not in str(error):
        error.args = (f"{error} {DETECTED_CPU_NOTE}", *error.args[1:])
    return error


def exact_budgets(budgets: Mapping[Device, Optional[int]]) -> dict[Device, str]:
    """Bytes computed by code, as the exact byte strings a user would write ("5000B"): what this library passes
    when it calls a user-facing entry (`placement.plan`, `from_pretrained`) with budgets it worked out, so that a
    small one is never refused as a unit left out. Unlimited (None) entries are left out."""
    return {device: f"{int(size)}B" for device, size in budgets.items() if size is not None}


def detect_budgets() -> Budgets:
    """Free memory of each accelerator (accelerate's `get_max_memory`; MPS: torch's recommended working set;
    virtual ones and the CPU: equal shares of available RAM) and available RAM, minus the margins."""
    accelerators = detect_accelerators()
    available = _available_ram()
    if accelerators.virtual:
        share = available // (accelerators.count + 1)
        free = {index: share for index in range(accelerators.count)}
        cpu = share
    elif accelerators.kind == "mps":
        free = {0: _mps_recommended_bytes(available)}
        cpu = available
    else:
        from accelerate.utils import get_max_memory

        found = get_max_memory()
        free = {key: value for key, value in found.items() if is_accelerator(key)}
        cpu = found.get("cpu", available)
    limits: dict[Device, Optional[int]] = {key: apply_accelerator_margin(value) for key, value in free.items()}
    limits["cpu"] = apply_cpu_margin(cpu)
    limits["disk"] = None
    return Budgets(limits=_ordered(limits), detected=frozenset(d for d in limits if d != "disk"))


def _mps_recommended_bytes(available: int) -> int:
    """Metal's recommended working-set size (what the MPS allocator may use of the shared RAM)."""
    try:
        return int(torch.mps.recommended_max_memory())
    except RuntimeError:  # an MPS backend reported available that cannot answer: share RAM as the CPU does
        return available


def apply_accelerator_margin(free: int) -> int:
    return max(0, free - max(int(free * ACCELERATOR_MARGIN), MIN_ACCELERATOR_MARGIN))


def apply_cpu_margin(available: int) -> int:
    return max(0, available - int(available * CPU_MARGIN))




def _available_ram() -> int:
    import psutil  # declared in pyproject.toml (accelerate needs it too)

    return int(psutil.virtual_memory().available)


def _device_key(key) -> Device:
    try:
        return normalize_device(key)
    except InvalidDeviceError as error:
        raise InvalidDeviceError(f"Unknown max_memory key {key!r}: {error}") from None


def warn_zero_budgets(devices, *, stacklevel: int = 2) -> None:
    """A `ZeroBudgetWarning` naming the accelerators among `devices` (those given a zero budget as text)."""
    zero = [device_label(device) for device in devices if is_accelerator(device)]
    if zero:
        them = "it" if len(zero) == 1 else "them"
        warnings.warn(
            f"max_memory gives {', '.join(zero)} a budget of 0 bytes: nothing can be placed there. Leave {them} "
            f"out of max_memory to plan without {them}, or give the memory to use (e.g. '24GiB').",
            ZeroBudgetWarning, stacklevel=stacklevel + 1,
        )


def _size(key, value) -> int:
    try:
        return parse_budget(value)
    except PlanError as error:
        raise PlanError(f"max_memory[{key!r}]: {error}") from None


def _ordered(limits: dict[Device, Optional[int]]) -> dict[Device, Optional[int]]:
    return {device: limits[device] for device in sorted(limits, key=device_sort_key)}
