"""Memory techniques on one model, under diffusers' `ModelMixin` method names, so code written for diffusers
(`transformer.enable_group_offload(...)`, `transformer.enable_layerwise_casting(...)`) runs unchanged.

Both apply a row of the technique table (`hooks.TECHNIQUES`, the same techniques the pipeline-level methods
use), with diffusers' arguments turned into its config by `hooks.diffusers_compat`; see docs/memory.md for
what each saves and costs."""

from __future__ import annotations

import os

import torch
from torch import nn

from hooks import (
    TECHNIQUES,
    GroupOffloadingConfig,
    LayerwiseCastingConfig,
    Technique,
    group_offloading_fields,
    layerwise_casting_fields,
)


class ModelMemoryMethods(nn.Module):
    """Mixed into `ModelMixin`."""

    # diffusers' name for the patterns a model keeps in its own dtype when casting (None: the hooks' default).
    _skip_layerwise_casting_patterns: tuple[str, ...] | None = None

    def enable_group_offload(
        self,
        onload_device: torch.device | int | str,
        offload_device: torch.device | str = "cpu",
        offload_type: str = "block_level",
        num_blocks_per_group: int | None = None,
        non_blocking: bool = False,
        use_stream: bool = False,
        record_stream: bool = False,
        low_cpu_mem_usage: bool = False,
        offload_to_disk_path: str | os.PathLike | None = None,
        block_modules=None,
        exclude_kwargs=None,
    ) -> None:
        """Group-offload this model: diffusers' signature, the group offloading row underneath."""
        fields = group_offloading_fields(None, dict(
            onload_device=onload_device, offload_device=offload_device, offload_type=offload_type,
            num_blocks_per_group=num_blocks_per_group, non_blocking=non_blocking, use_stream=use_stream,
            record_stream=record_stream, low_cpu_mem_usage=low_cpu_mem_usage,
            offload_to_disk_path=offload_to_disk_path, block_modules=block_modules, exclude_kwargs=exclude_kwargs,
        ))
        TECHNIQUES[Technique.GROUP_OFFLOAD].apply(self, GroupOffloadingConfig(**fields))

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Store Linear/Conv weights in `storage_dtype`, compute in `compute_dtype` (None: the model's current
        dtype, as diffusers does). `non_blocking` is accepted for diffusers' signature; casts are on-device."""
        if compute_dtype is None:
            compute_dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        if skip_modules_pattern is None:
            skip_modules_pattern = self._skip_layerwise_casting_patterns
        fields = layerwise_casting_fields(storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes,
                                          non_blocking)
        TECHNIQUES[Technique.LAYERWISE_CASTING].apply(self, LayerwiseCastingConfig(**fields))
