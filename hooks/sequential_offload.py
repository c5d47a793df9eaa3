"""Sequential offload: every layer's weights stay in CPU RAM and visit the accelerator only while it runs.

    apply_sequential_cpu_offload(denoiser, execution_device=0)

This is accelerate's `cpu_offload` (an `AlignDevicesHook` per module holding tensors, weights read from a
CPU state dict per call, `meta` placeholders in between). It needs the least accelerator memory and is by
far the slowest technique: each layer waits for its own synchronous copy (see docs/memory.md for the
measured ratio); group offloading with `offload_type="leaf_level", use_stream=True` saves as much and
overlaps the copies with compute.
"""

from __future__ import annotations

import torch
from accelerate.big_modeling import cpu_offload
from accelerate.hooks import AlignDevicesHook, CpuOffload
from torch import nn

from .hook_utils import find_hooks, has_hook, remove_hooks_of_type
from .memory_errors import OffloadConflictError
from .offload_devices import resolve_execution_device

__all__ = ["apply_sequential_cpu_offload", "remove_sequential_cpu_offload"]


def apply_sequential_cpu_offload(module: nn.Module, execution_device=None) -> torch.device:
    """Sequentially offload `module`; applying again replaces it. Returns the execution device."""
    device = resolve_execution_device(execution_device)
    _refuse_other_offloading(module)
    remove_sequential_cpu_offload(module)
    cpu_offload(module, execution_device=device)
    return device


def remove_sequential_cpu_offload(module: nn.Module) -> None:
    """Remove the sequential offload hooks; weights come back from the CPU state dict, the module is on the CPU."""
    if remove_hooks_of_type(module, AlignDevicesHook):
        module.to("cpu")


def _refuse_other_offloading(module: nn.Module) -> None:
    from .group_offload.offload import refuse_group_offloaded  # a sibling technique; imported here to keep files independent
    from .layerwise_casting import LayerwiseCastingHook

    refuse_group_offloaded(module, "sequential offload")

    if has_hook(module, LayerwiseCastingHook):
        raise OffloadConflictError(
            f"{type(module).__name__} has layerwise casting, which sequential offload would bypass (it restores "
            "each layer from its own state dict before the cast hook runs). Use group offloading with "
            "offload_type='leaf_level' instead (it keeps the stored dtype), or model offload."
        )
    if has_hook(module, CpuOffload):
        raise OffloadConflictError(
            f"{type(module).__name__} is model-offloaded; remove that first (hooks.remove_model_cpu_offload(module); "
            "on a pipeline: reset_device_map())."
        )
    # cpu_offload's own root hook only moves inputs (no execution device); a dispatch hook has one.
    mapped = [
        name or "<root>"
        for name, _, hook in find_hooks(module, AlignDevicesHook)
        if not hook.offload and hook.execution_device is not None
    ]
    if mapped:
        raise OffloadConflictError(
            f"{type(module).__name__} is dispatched by a device map (AlignDevicesHooks at {mapped[:3]}); "
            "remove it first (on a pipeline: reset_device_map())."
        )
