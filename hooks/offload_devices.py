"""The execution device of the offload techniques when the caller does not name one."""

from __future__ import annotations

import torch

from placement.devices import accelerators_present, normalize_device, torch_device
from placement.errors import InvalidDeviceError

from .memory_errors import OffloadConfigError


def resolve_execution_device(device=None) -> torch.device:
    """`device` as a torch.device; None means accelerator 0, or the CPU on a machine without one.

    Offloading "to the CPU" and executing on the CPU moves nothing, but it runs every hook of the technique:
    that is how CPU-only machines (CI) exercise the code path.
    """
    if device is None:
        return torch_device(0) if accelerators_present() else torch.device("cpu")
    try:
        resolved = torch_device(normalize_device(device))  # "disk" is refused there: it cannot execute
    except InvalidDeviceError as error:
        raise OffloadConfigError(f"Execution device {device!r} is not usable: {error}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise OffloadConfigError(
            f"Execution device {device!r} needs CUDA, which this machine does not have; pass device=None "
            "(the CPU then executes) or run on a GPU machine."
        )
    return resolved
