"""Devices as the device maps spell them (accelerate's `hf_device_map`): accelerator ints, then "cpu" and "disk".

`detect_accelerators()` is the one place that says which accelerators this machine has, and `torch_device()` the
one seam where a planned index becomes a torch device (CUDA, else XPU, else MPS). `PLACEMENT_VIRTUAL_ACCELERATORS=N`
makes the library see N CPU-backed accelerators, strict (`placement.virtual`) unless `PLACEMENT_VIRTUAL_STRICT=0`.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from .errors import InvalidDeviceError
from .virtual import BACKEND_NAME, ensure_backend

VIRTUAL_ACCELERATORS_ENV = "PLACEMENT_VIRTUAL_ACCELERATORS"
VIRTUAL_STRICT_ENV = "PLACEMENT_VIRTUAL_STRICT"

Device = Union[int, str]  # int accelerator index, "cpu" or "disk"
HOST_DEVICES = ("cpu", "disk")


def normalize_device(spec) -> Device:
    """0 / "0" / "cuda" / "cuda:1" / torch.device -> int; "cpu" / "disk" as they are; else an error."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if is_accelerator(spec) and spec >= 0:
        return spec
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in HOST_DEVICES:
            return text
        if text.isdigit():
            return int(text)
        kind, _, index = text.partition(":")
        if kind in ("cuda", "xpu", "mps", "npu", BACKEND_NAME) and (index == "" or index.isdigit()):
            return int(index or 0)
    raise InvalidDeviceError(_invalid(spec))


def is_accelerator(device: Device) -> bool:
    return isinstance(device, int) and not isinstance(device, bool)


@dataclass(frozen=True, kw_only=True)
class Accelerators:
    """The accelerators this process sees: how many, their torch device type, and whether they are virtual."""

    count: int
    kind: str  # torch device type: "cuda", "xpu", "mps"; "vgpu" for virtual ones ("cpu" when not strict);
    # "cuda" when there are none
    virtual: bool = False

    def torch_device(self, index: int) -> torch.device:
        if self.virtual and self.kind == BACKEND_NAME:
            ensure_backend()
            return torch.device(BACKEND_NAME, index)
        if self.virtual:
            return torch.device("cpu")
        if self.kind == "mps":
            return torch.device("mps")  # one device; torch spells it without an index
        return torch.device(self.kind, index)


# The accelerators of the load in progress (`detected_for_load`); None outside one: each call detects afresh.
_LOAD_ACCELERATORS: ContextVar[Optional[Accelerators]] = ContextVar("placement_load_accelerators", default=None)


@contextlib.contextmanager
def detected_for_load(accelerators: Accelerators) -> Iterator[Accelerators]:
    """Within one load, `detect_accelerators()` answers `accelerators` (detected once at its start): its plan,
    budgets, profile and hooks see the same devices, and the device is not probed again per step. Scoped to the
    load, not cached: the next load detects again, so a device change between loads is seen."""
    token = _LOAD_ACCELERATORS.set(accelerators)
    try:
        yield accelerators
    finally:
        _LOAD_ACCELERATORS.reset(token)


def detect_accelerators() -> Accelerators:
    """The accelerators present: `PLACEMENT_VIRTUAL_ACCELERATORS` if set, else CUDA, else XPU, else MPS (within a
    load, those it detected at its start: `detected_for_load`)."""
    held = _LOAD_ACCELERATORS.get()
    if held is not None:
        return held
    virtual = virtual_accelerator_count()
    if virtual is not None:
        return Accelerators(count=virtual, kind=BACKEND_NAME if strict_virtual_accelerators() else "cpu", virtual=True)
    if torch.cuda.is_available():
        return Accelerators(count=torch.cuda.device_count(), kind="cuda")
    if torch.xpu.is_available():
        return Accelerators(count=torch.xpu.device_count(), kind="xpu")
    if torch.backends.mps.is_available():
        return Accelerators(count=1, kind="mps")
    return Accelerators(count=0, kind="cuda")


def accelerators_present() -> int:
    """How many accelerators this process sees (virtual ones included): `detect_accelerators().count`."""
    return detect_accelerators().count


def virtual_accelerator_count() -> int | None:
    """N from `PLACEMENT_VIRTUAL_ACCELERATORS=N` (unset or empty: None); anything but an int >= 0 is an error."""
    text = os.environ.get(VIRTUAL_ACCELERATORS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise InvalidDeviceError(
            f"{VIRTUAL_ACCELERATORS_ENV}={text!r}: expected a number of virtual accelerators (e.g. 2), "
            "or leave it unset to use the real ones."
        )
    return int(text)


def strict_virtual_accelerators() -> bool:
    """Whether virtual accelerators are strict (the default; `PLACEMENT_VIRTUAL_STRICT=0`: not), the escape hatch
    for what a Python backend cannot do: backward through a virtual accelerator other than 0 (autograd sizes its
    device queues from a C++ count) and `torch.Generator(device="vgpu")`."""
    text = os.environ.get(VIRTUAL_STRICT_ENV, "").strip().lower()
    if text in ("", "1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidDeviceError(f"{VIRTUAL_STRICT_ENV}={text!r}: expected 1 (strict, the default) or 0.")


def torch_device(device: Device, accelerators: Accelerators | None = None) -> torch.device:
    """The torch.device that executes on `device` ("cuda:1", "xpu:1", "mps", "vgpu:1"; "disk" executes nowhere).
    Without accelerators an index maps to "cuda:N", which fails where it is used, not here."""
    check_can_execute(device, what="execution device")
    if device == "cpu":
        return torch.device("cpu")
    if not is_accelerator(device):
        return torch_device(normalize_device(device), accelerators)
    return (accelerators or detect_accelerators()).torch_device(device)


def safetensors_device(device: torch.device) -> str:
    """The device safetensors reads a tensor onto, for a tensor wanted on `device`: `device` itself, except a
    virtual accelerator's "vgpu:k", which safetensors does not know: "cpu" there (the reader moves it on)."""
    return "cpu" if device.type == BACKEND_NAME else str(device)


def check_can_execute(device: Device, *, what: str) -> None:
    """The one check that "disk" is not used where something must run: the disk holds weights, it never
    executes them. `what` names the argument or component in the message."""
    if device == "disk":
        raise InvalidDeviceError(
            f"{what}: 'disk' holds weights but cannot execute them. Run on an accelerator or 'cpu'; to keep "
            "weights on disk, use a strategy ('auto', 'balanced', ...) with an offload_folder."
        )


def device_sort_key(device: Device) -> tuple[int, int]:
    """Accelerators by index, then cpu, then disk: the order every table and map is printed in."""
    if is_accelerator(device):
        return (0, device)
    return (1, HOST_DEVICES.index(device))


def device_label(device: Device) -> str:
    """"GPU 1", "CPU", "disk": how tables and messages name a device."""
    if is_accelerator(device):
        return f"GPU {device}"
    return "CPU" if device == "cpu" else "disk"


def _invalid(spec) -> str:
    return (
        f"Invalid device {spec!r}: expected an accelerator index (0, 1, ...), 'cuda', 'cuda:N', "
        "a torch.device, 'cpu' or 'disk'."
    )
