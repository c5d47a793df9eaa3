"""Devices as the device maps spell them: accelerator indices are plain ints, then "cpu" and "disk".

This is the spelling of accelerate, diffusers and transformers `hf_device_map`s; `torch.device("cuda:1")`,
"cuda:1" and 1 all normalise to 1 so that maps compare equal whatever the user typed.
"""

from __future__ import annotations

from typing import Union

import torch

from .errors import InvalidDeviceError

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
        if kind in ("cuda", "xpu", "mps", "npu") and (index == "" or index.isdigit()):
            return int(index or 0)
    raise InvalidDeviceError(_invalid(spec))


def is_accelerator(device: Device) -> bool:
    return isinstance(device, int) and not isinstance(device, bool)


def torch_device(device: Device) -> torch.device:
    """The torch.device that executes on `device` ("disk" executes nowhere: its weights stream to an accelerator)."""
    check_can_execute(device, what="execution device")
    if device == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator_type(), device)


def check_can_execute(device: Device, *, what: str) -> None:
    """The one check that "disk" is not used where something must run: the disk holds weights, it never
    executes them. `what` names the argument or component in the message."""
    if device == "disk":
        raise InvalidDeviceError(
            f"{what}: 'disk' holds weights but cannot execute them. Run on an accelerator or 'cpu'; to keep "
            "weights on disk, use a strategy ('auto', 'balanced', ...) with an offload_folder."
        )


def accelerators_present() -> int:
    """How many accelerators this machine has (CUDA, else XPU)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.xpu.device_count()
    return 0


def accelerator_type() -> str:
    """The torch device type of this machine's accelerators ("cuda" when there are none, for planning)."""
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cuda"


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
