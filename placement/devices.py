"""Devices as the device maps spell them: accelerator indices are plain ints, then "cpu" and "disk".

This is the spelling of accelerate, diffusers and transformers `hf_device_map`s; `torch.device("cuda:1")`,
"cuda:1" and 1 all normalise to 1 so that maps compare equal whatever the user typed.

`detect_accelerators()` is the one place that says which accelerators this machine has, and `torch_device()`
the one seam where a planned accelerator index becomes a real torch device: CUDA, else XPU, else Apple MPS
(one device, "mps"). The test mode `PLACEMENT_VIRTUAL_ACCELERATORS=N` (read at every call) makes the library
see N accelerators backed by the CPU: plans, loads and hooks are those of an N-GPU machine, tensors live in RAM.
It is strict (`placement.virtual`): accelerator k is the torch device `vgpu:k`, each tensor stays on the virtual
device it was moved to, and mixing two devices in one op raises as on CUDA. `PLACEMENT_VIRTUAL_STRICT=0` turns
that off (every virtual accelerator is then the plain CPU device), for what a Python backend cannot do: see
`strict_virtual_accelerators()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

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
    if isinstance(spec, bool):
        raise InvalidDeviceError(_invalid(spec))
    if isinstance(spec, int):
        if spec < 0:
            raise InvalidDeviceError(_invalid(spec))
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


def detect_accelerators() -> Accelerators:
    """The accelerators present: `PLACEMENT_VIRTUAL_ACCELERATORS` if set, else CUDA, else XPU, else MPS."""
    virtual = virtual_accelerator_count()
    if virtual is not None:
        return Accelerators(count=virtual, kind=BACKEND_NAME if strict_virtual_accelerators() else "cpu", virtual=True)
    if torch.cuda.is_available():
        return Accelerators(count=torch.cuda.device_count(), kind="cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Accelerators(count=torch.xpu.device_count(), kind="xpu")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
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
    """Whether virtual accelerators are strict (the default): `PLACEMENT_VIRTUAL_STRICT=0` says they are not.

    The escape hatch exists for what torch's Python backend cannot do: autograd's backward pass through a
    virtual accelerator other than 0 (the engine sizes its device queues from a C++ device count a Python
    backend cannot set) and `torch.Generator(device="vgpu")` (no generator hooks for a Python backend).
    safetensors knows only real device types: read onto "cpu" for a virtual one (`safetensors_device`).
    Everything else a pipeline does runs strict (`cpu_param.data = virtual_tensor` too, as diffusers' group
    offloading does it: `placement.virtual.DATA_PROPERTY`)."""
    text = os.environ.get(VIRTUAL_STRICT_ENV, "").strip().lower()
    if text in ("", "1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidDeviceError(f"{VIRTUAL_STRICT_ENV}={text!r}: expected 1 (strict, the default) or 0.")


def torch_device(device: Device, accelerators: Accelerators | None = None) -> torch.device:
    """The torch.device that executes on `device` ("disk" executes nowhere: its weights stream to an accelerator).

    An accelerator index maps to this machine's accelerator type ("cuda:1", "xpu:1", "mps"; a virtual one to
    "vgpu:1", or "cpu" when not strict); on a machine without accelerators it maps to "cuda:N", which fails where
    it is used, not here. `accelerators`: what `detect_accelerators()` found, when the caller already asked (a load
    asks once)."""
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
