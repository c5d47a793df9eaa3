"""The two steps around planning for any module built on meta: size it right, then load and dispatch it.

    with init_empty_weights(): module = build()
    cast_meta(module, weights, dtype=..., keep_in_fp32=...)   # meta tensors get their load dtype: exact sizes
    plan = placement.plan({name: module}, ...)                  # one planner for models and pipelines
    load_component(module, weights, plan.components[name])      # stream weights, then the kind's hooks
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from hooks.dispatch import DiskWeights, undispatch
from hooks.plan_dispatch import apply_component_plan
from placement.device_maps import owning_key
from placement.devices import Device, normalize_device
from placement.plan_schema import ComponentPlan

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


def stream_component(
    module: nn.Module,
    weights: WeightsIndex,
    component: ComponentPlan,
    *,
    dtype: torch.dtype | None = None,
    keep_in_fp32: Iterable[str] = (),
    tied_weights: Mapping[str, str] | None = None,
    progress: bool = True,
    label: str | None = None,
) -> DiskWeights | None:
    """Stream `weights` into `module` (built on meta) to the devices `component` plans; returns the offload
    index serving its disk part from the checkpoint's own files (None when nothing is on disk).

    The one loader of planned weights: `ModelMixin.from_pretrained` and the pipeline loader both use it.
    On failure every tensor loaded so far goes back to meta (`load_weights`)."""
    keep = tuple(keep_in_fp32 or ())
    load_weights(module, weights, device_map=component.device_map, dtype=dtype, keep_in_fp32=keep,
                 tied_weights=tied_weights, progress=progress, label=label)
    return disk_offload_index(module, weights, component.device_map, dtype=dtype, keep_in_fp32=keep,
                              tied_weights=tied_weights)


def load_component(
    module: nn.Module,
    weights: WeightsIndex,
    component: ComponentPlan,
    *,
    hooks: bool = True,
    dtype: torch.dtype | None = None,
    keep_in_fp32: Iterable[str] = (),
    tied_weights: Mapping[str, str] | None = None,
    progress: bool = True,
) -> nn.Module:
    """`stream_component`, then the runtime of its placement kind (`hooks.plan_dispatch.apply_component_plan`);
    `hooks=False` (a single-device strategy: the weights already sit where they run) only records the map.

    A failure anywhere leaves the module hook-free with every tensor on meta: nothing half-loaded escapes."""
    try:
        disk_weights = stream_component(module, weights, component, dtype=dtype, keep_in_fp32=keep_in_fp32,
                                        tied_weights=tied_weights, progress=progress)
        if hooks:
            apply_component_plan(module, component, disk_weights=disk_weights)
        else:
            module.hf_device_map = dict(component.device_map)
    except BaseException:
        undispatch(module)
        module.to("meta")
        module.hf_device_map = None
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
