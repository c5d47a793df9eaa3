"""Where the runtime executes: a user's device spec as a place (the plan's spelling) and as a torch device.

A *place* is a device as device maps spell it: an accelerator index, "cpu" or "disk" (`placement.devices`).
The runtime keeps the place beside the torch device because under `PLACEMENT_VIRTUAL_ACCELERATORS` with
`PLACEMENT_VIRTUAL_STRICT=0` an accelerator's torch device is the CPU: only the place says that a copy to it
crosses the bus (the transfer meter counts it as a GPU copy; strict, it is `vgpu:k` and says so itself).
Techniques resolve their configs' devices here.
"""

from __future__ import annotations

import torch

from placement.devices import Device, accelerators_present, is_accelerator, normalize_device, torch_device
from placement.errors import InvalidDeviceError

from .errors import OffloadConfigError


def execution_place(device=None) -> Device:
    """`device` as a place that can execute; None means accelerator 0, or the CPU on a machine without one.

    Offloading "to the CPU" and executing on the CPU moves nothing, but it runs every hook of the technique:
    that is how CPU-only machines (CI) exercise the code path.
    """
    if device is None:
        return 0 if accelerators_present() else "cpu"
    try:
        place = normalize_device(device)
        resolved = torch_device(place)  # "disk" is refused there: it cannot execute
    except InvalidDeviceError as error:
        raise OffloadConfigError(f"Execution device {device!r} is not usable: {error}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise OffloadConfigError(
            f"Execution device {device!r} needs CUDA, which this machine does not have; pass device=None "
            "(the CPU then executes) or run on a GPU machine."
        )
    return place


def resolve_execution_device(device=None) -> torch.device:
    """`execution_place(device)` as the torch device that computes there."""
    return torch_device(execution_place(device))


def place_of_device(device: torch.device) -> Device:
    """The place of a real torch device: "cuda:1" -> 1, "mps" -> 0, "cpu" -> "cpu" ("meta" counts as host)."""
    if device.type in ("cpu", "meta"):
        return "cpu"
    return device.index or 0


def is_host(place: Device) -> bool:
    return not is_accelerator(place)


__all__ = ["execution_place", "is_host", "place_of_device", "resolve_execution_device"]
