"""diffusers' spellings of the memory techniques, turned into our configs, so code written for diffusers runs
unchanged. Every technique takes one shape, `apply_x(module, config)`; the other spellings end here.

Group offloading, `apply_group_offloading(module, onload_device=..., offload_type=..., num_blocks_per_group=...)`:
- onload_device (also diffusers' second positional argument), offload_device, offload_type,
  num_blocks_per_group, use_stream, offload_to_disk_path: the `GroupOffloadingConfig` field of the same name
  (num_blocks_per_group=None means 1, as for leaf_level);
- non_blocking, record_stream, low_cpu_mem_usage: accepted; they tune how diffusers copies, and ours decides
  that itself (copies are asynchronous exactly when use_stream prefetches, from memory pinned once);
- block_modules, exclude_kwargs: not supported; passing one is an error rather than silently ignored.
Layerwise casting, `apply_layerwise_casting(module, storage_dtype, compute_dtype, skip_modules_pattern,
skip_modules_classes, non_blocking)`: the `LayerwiseCastingConfig` fields (non_blocking accepted: casts run on
the weights' own device).
Model and sequential offload, `apply_x(module, execution_device=...)`: the config's `execution_device`.
"""

from __future__ import annotations

from typing import Any

from .errors import OffloadConfigError

GROUP_OFFLOAD_FIELDS = ("onload_device", "offload_device", "offload_type", "num_blocks_per_group", "use_stream",
                        "offload_to_disk_path")
TUNING_ONLY = ("non_blocking", "record_stream", "low_cpu_mem_usage")
UNSUPPORTED = ("block_modules", "exclude_kwargs")
LAYERWISE_CASTING_FIELDS = ("storage_dtype", "compute_dtype", "skip_modules_pattern", "skip_modules_classes")


def group_offloading_fields(positional: Any, keywords: dict[str, Any]) -> dict[str, Any]:
    """The `GroupOffloadingConfig` fields for `apply_group_offloading(module, positional, **keywords)` where
    `positional` is diffusers' second argument (onload_device) or None."""
    unknown = sorted(set(keywords) - set(GROUP_OFFLOAD_FIELDS) - set(TUNING_ONLY) - set(UNSUPPORTED))
    if unknown:
        raise OffloadConfigError(
            f"apply_group_offloading got unknown keywords {unknown}; it takes a GroupOffloadingConfig or "
            f"diffusers' keywords {[*GROUP_OFFLOAD_FIELDS, *TUNING_ONLY]}."
        )
    unsupported = sorted(key for key in UNSUPPORTED if keywords.get(key) is not None)
    if unsupported:
        raise OffloadConfigError(
            f"apply_group_offloading: {unsupported} are diffusers options this library does not implement; "
            "leave them out (groups follow the module's block lists; every forward keyword is moved)."
        )
    fields = {key: keywords[key] for key in GROUP_OFFLOAD_FIELDS if keywords.get(key) is not None}
    if positional is not None:
        if "onload_device" in fields:
            raise OffloadConfigError("apply_group_offloading got onload_device twice (by position and keyword).")
        fields["onload_device"] = positional
    if "onload_device" not in fields:
        raise OffloadConfigError(
            "apply_group_offloading needs an onload_device (e.g. onload_device=torch.device('cuda')) or a "
            "GroupOffloadingConfig."
        )
    return fields


def layerwise_casting_fields(storage_dtype: Any, compute_dtype: Any, skip_modules_pattern: Any,
                             skip_modules_classes: Any, non_blocking: bool = False) -> dict[str, Any]:
    """The `LayerwiseCastingConfig` fields for diffusers' positional/keyword spelling (None: the default)."""
    del non_blocking  # accepted for diffusers' signature: casts run on the weights' own device
    values = dict(zip(LAYERWISE_CASTING_FIELDS, (storage_dtype, compute_dtype, skip_modules_pattern,
                                                 skip_modules_classes)))
    return {key: value for key, value in values.items() if value is not None}


def config_with_execution_device(config: Any, config_class: type, execution_device: Any, *, function: str) -> Any:
    """`config`, or `config_class(execution_device=...)` for the keyword spelling; both is an error."""
    if config is None:
        return config_class(execution_device=execution_device)
    if execution_device is not None:
        raise OffloadConfigError(f"{function}: pass a {config_class.__name__} or execution_device=, not both.")
    if not isinstance(config, config_class):
        raise OffloadConfigError(f"{function}: expected a {config_class.__name__}, got {type(config).__name__}.")
    return config


__all__ = ["config_with_execution_device", "group_offloading_fields", "layerwise_casting_fields"]
