"""Apply one component's placement (a `placement.ComponentPlan`) to its loaded module.

The loader has already put every weight where the plan says (accelerator, CPU RAM, or left on meta for
disk). This attaches the runtime that makes the module run there:
- whole / split / cpu: input-moving hooks (`dispatch`): one at the top of a component placed whole, one per
  device-map entry of a split one; the outputs go back to the caller's device;
- offloaded on an accelerator, all weights in CPU RAM: block-level group offloading (a whole block moved per
  transfer, prefetched on a side CUDA stream from pinned memory) rather than accelerate's per-leaf streaming;
  its outputs go back to the caller's device too (`ReturnOutputsHook`);
- offloaded with part of its weights resident on accelerators (a model-level map, as accelerate's "auto"
  makes): `dispatch`, which keeps the resident part where the plan put it and streams only the "cpu" part
  (group offloading would take every weight into its CPU store, beyond what the plan gave the CPU);
- disk: weight-serving hooks reading the checkpoint's own safetensors files.
Accelerator indices become torch devices through `placement.devices.torch_device` (virtual ones: `vgpu:k`).
"""

from __future__ import annotations

import torch
from torch import nn

from placement.devices import is_accelerator, torch_device
from placement.plan_schema import ComponentPlan, PlacementKind

from .dispatch import DiskWeights, dispatch, undispatch
from .group_offload.offload import GroupOffloadingConfig, apply_group_offloading
from .hook_utils import add_hook_first
from .input_moving import ReturnOutputsHook


def apply_component_plan(module: nn.Module, component: ComponentPlan, *,
                         disk_weights: DiskWeights | None = None) -> nn.Module:
    """Attach the hooks that run `module` as `component` places it; sets `module.hf_device_map`.

    `hooks.dispatch.undispatch(module)` removes them all again (group offloading included).
    """
    execution = component.execution_device
    if component.kind is PlacementKind.OFFLOADED and is_accelerator(execution) and _all_on_host(component):
        _apply_group_offload(module, torch_device(execution))
        module.hf_device_map = dict(component.device_map)
        return module
    return dispatch(module, component.device_map, execution_device=execution, disk_weights=disk_weights)


def _all_on_host(component: ComponentPlan) -> bool:
    return not any(is_accelerator(device) for device in component.device_map.values())


def _apply_group_offload(module: nn.Module, onload_device: torch.device) -> None:
    config = GroupOffloadingConfig(onload_device=onload_device, offload_type="block_level",
                                   use_stream=onload_device.type == "cuda")
    try:
        apply_group_offloading(module, config)
        # Outputs back where the inputs came from, as for the other placement kinds: a pipeline that joins an
        # offloaded encoder's output with a whole one's (SD3's pooled embeddings) gets both on one device.
        add_hook_first(module, ReturnOutputsHook())
    except BaseException:
        undispatch(module)
        raise
