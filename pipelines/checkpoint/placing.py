"""The two steps around planning for any module built on meta: size it right, then load and dispatch it.

    with init_empty_weights(): module = build()
    cast_meta(module, weights, dtype=..., keep_in_fp32=...)   # meta tensors get their load dtype: exact sizes
    device_map = <plan>(module, ...)                           # model-level or pipeline-level planning
    load_and_dispatch(module, weights, device_map, ...)        # stream weights, attach hooks when needed
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from hooks.dispatch import dispatch, undispatch
from placement.devices import Device, normalize_device
from placement.splitting import owning_key

from .dtypes import check_dtypes
from .index import WeightsIndex
from .loading import load_weights, target_dtype


def cast_meta(
    module: nn.Module, weights: WeightsIndex, *, dtype: torch.dtype | None, keep_in_fp32: Iterable[str] = ()
) -> None:
    """Give every meta tensor the dtype it will be loaded as, so that sizing (`compute_module_sizes`) is exact.

    Costs nothing: meta tensors hold no memory. Tensors that already hold data are left alone.
    Raises `CheckpointDtypeError` first for a checkpoint tensor the model cannot take (see `check_dtypes`).
    """
    keep = tuple(keep_in_fp32 or ())
    names = dict(module.state_dict(keep_vars=True))
    check_dtypes(module, weights, dtype=dtype, keep_in_fp32=keep)
    for name, entry in weights.tensors.items():
        tensor = names.get(name)
        if tensor is None or tensor.device.type != "meta":
            continue
        set_module_tensor_to_device(module, name, "meta", dtype=target_dtype(entry, dtype, keep))


def needs_hooks(device_map: Mapping[str, Device]) -> bool:
    """Hooks are needed when weights span devices, live on disk, or sit on the CPU while an accelerator runs."""
    devices = {normalize_device(device) for device in device_map.values()}
    return len(devices) > 1 or "disk" in devices


def load_and_dispatch(
    module: nn.Module,
    weights: WeightsIndex,
    device_map: Mapping[str, Device] | None,
    *,
    dtype: torch.dtype | None = None,
    keep_in_fp32: Iterable[str] = (),
    tied_weights: Mapping[str, str] | None = None,
    progress: bool = True,
) -> nn.Module:
    """Stream `weights` into `module` as `device_map` places them, then attach hooks if the map needs them.

    `device_map` None loads everything on the CPU and leaves `hf_device_map` None. Disk entries are served
    from the checkpoint files. On failure the module is left hook-free with every tensor on meta.
    """
    keep = tuple(keep_in_fp32 or ())
    load_weights(
        module, weights, device_map=device_map, dtype=dtype, keep_in_fp32=keep,
        tied_weights=tied_weights, progress=progress,
    )
    if device_map is None:
        module.hf_device_map = None
        return module
    normalized = {name: normalize_device(device) for name, device in device_map.items()}
    try:
        if needs_hooks(normalized):
            index = disk_offload_index(
                module, weights, normalized, dtype=dtype, keep_in_fp32=keep, tied_weights=tied_weights
            )
            dispatch(module, normalized, disk_weights=index)  # executes on its first accelerator, else the CPU
        else:
            module.hf_device_map = normalized  # one device: the weights are already there, no hooks needed
    except BaseException:
        undispatch(module)
        module.to("meta")
        raise
    return module


def disk_offload_index(
    module: nn.Module,
    weights: WeightsIndex,
    device_map: Mapping[str, Device],
    *,
    dtype: torch.dtype | None = None,
    keep_in_fp32: Iterable[str] = (),
    tied_weights: Mapping[str, str] | None = None,
) -> dict[str, dict[str, str]] | None:
    """The `disk_weights` for `hooks.dispatch.dispatch`: every parameter `device_map` puts on "disk", served
    from its checkpoint file in its load dtype; a tied parameter by its source, even when the source itself is
    not on disk (accelerate's hook asks for it by the tied name). None when nothing is on disk."""
    disk = [name for name, device in device_map.items() if normalize_device(device) == "disk"]
    if not disk:
        return None
    keep = tuple(keep_in_fp32 or ())
    sources = _disk_sources(module, weights, disk, tied_weights or {})
    return weights.offload_index(sources, lambda entry: target_dtype(entry, dtype, keep))


def _disk_sources(
    module: nn.Module, weights: WeightsIndex, prefixes: list[str], tied_weights: Mapping[str, str]
) -> dict[str, str]:
    """{parameter under a disk prefix: checkpoint tensor serving it}; a tied parameter is served by its source."""
    sources = {}
    for name, _ in module.named_parameters(remove_duplicate=False):
        if owning_key(name, prefixes) is not None:
            source = name if name in weights.tensors else tied_weights.get(name)
            if source is not None:
                sources[name] = source
    return sources
