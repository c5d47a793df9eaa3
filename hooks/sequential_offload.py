"""Sequential offload: every layer's weights stay in CPU RAM and visit the accelerator only while it runs.

    apply_sequential_cpu_offload(denoiser, SequentialOffloadConfig(execution_device=0))
    apply_sequential_cpu_offload(denoiser, execution_device=0)   # the same, diffusers' spelling

This is accelerate's `cpu_offload` (an `AlignDevicesHook` per module holding tensors, weights read from a
CPU state dict per call, `meta` placeholders in between). It needs the least accelerator memory and is by
far the slowest technique: each layer waits for its own synchronous copy (see docs/memory.md for the
measured ratio); group offloading with `offload_type="leaf_level", use_stream=True` saves as much and
overlaps the copies with compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate.big_modeling import cpu_offload
from accelerate.hooks import AlignDevicesHook
from torch import nn

from .hook_utils import remove_hooks_of_type
from .offload_devices import resolve_execution_device
from .techniques import Technique, check_compatible

__all__ = ["SequentialOffloadConfig", "apply_sequential_cpu_offload", "remove_sequential_cpu_offload"]


@dataclass(frozen=True, kw_only=True)
class SequentialOffloadConfig:
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


def apply_sequential_cpu_offload(
    module: nn.Module, config: SequentialOffloadConfig | None = None, *, execution_device=None
) -> torch.device:
    """Sequentially offload `module`; applying again replaces it. Returns the execution device.

    `execution_device=` alone is the same as `SequentialOffloadConfig(execution_device=...)`."""
    config = config or SequentialOffloadConfig(execution_device=execution_device)
    device = resolve_execution_device(config.execution_device)
    check_compatible(module, Technique.SEQUENTIAL_OFFLOAD)
    remove_sequential_cpu_offload(module)
    cpu_offload(module, execution_device=device)
    return device


def remove_sequential_cpu_offload(module: nn.Module) -> None:
    """Remove the sequential offload hooks; weights come back from the CPU state dict, the module is on the CPU."""
    if remove_hooks_of_type(module, AlignDevicesHook):
        module.to("cpu")
