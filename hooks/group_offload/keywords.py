"""diffusers' `apply_group_offloading(module, onload_device=..., offload_type=..., num_blocks_per_group=...)`
keywords, turned into our `GroupOffloadingConfig`, so code written for diffusers runs unchanged.

What each diffusers keyword becomes:
- onload_device, offload_device, offload_type, num_blocks_per_group, use_stream, offload_to_disk_path: the
  config field of the same name (num_blocks_per_group=None means 1, as for leaf_level);
- non_blocking, record_stream, low_cpu_mem_usage: accepted; they tune how diffusers copies, and ours decides
  that itself (copies are asynchronous exactly when use_stream prefetches, from memory pinned once);
- block_modules, exclude_kwargs: not supported; passing one is an error rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from ..memory_errors import OffloadConfigError

CONFIG_FIELDS = ("onload_device", "offload_device", "offload_type", "num_blocks_per_group", "use_stream",
                 "offload_to_disk_path")
TUNING_ONLY = ("non_blocking", "record_stream", "low_cpu_mem_usage")
UNSUPPORTED = ("block_modules", "exclude_kwargs")


def config_fields(positional: Any, keywords: dict[str, Any]) -> dict[str, Any]:
    """The `GroupOffloadingConfig` fields for `apply_group_offloading(module, positional, **keywords)` where
    `positional` is diffusers' second argument (onload_device) or None."""
    unknown = sorted(set(keywords) - set(CONFIG_FIELDS) - set(TUNING_ONLY) - set(UNSUPPORTED))
    if unknown:
        raise OffloadConfigError(
            f"apply_group_offloading got unknown keywords {unknown}; it takes a GroupOffloadingConfig or "
            f"diffusers' keywords {[*CONFIG_FIELDS, *TUNING_ONLY]}."
        )
    unsupported = sorted(key for key in UNSUPPORTED if keywords.get(key) is not None)
    if unsupported:
        raise OffloadConfigError(
            f"apply_group_offloading: {unsupported} are diffusers options this library does not implement; "
            "leave them out (groups follow the module's block lists; every forward keyword is moved)."
        )
    fields = {key: keywords[key] for key in CONFIG_FIELDS if keywords.get(key) is not None}
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
