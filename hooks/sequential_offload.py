"""Sequential offload: accelerate's `cpu_offload` (every layer's weights in a CPU state dict, visiting the
accelerator only while it runs) with `dispatch`'s weight-serving hooks, which keep the caller's lists and meter
what they serve. The least memory and by far the slowest (docs/memory.md); group offloading at leaf level with
a stream saves as much and overlaps the copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from accelerate.utils import find_tied_parameters, retie_parameters
from torch import nn

from placement.devices import torch_device

from .dispatch import device_map_editor, serve_weights
from .gather import served_slots
from .hook_utils import remove_hooks_of_type
from .input_moving import MoveInputsHook, config_with_execution_device, execution_place
from .techniques import Handle, Technique, TechniqueConfig, TechniqueSpec, check_compatible, register

__all__ = ["SPEC", "SequentialOffloadConfig", "apply_sequential_cpu_offload", "remove_sequential_cpu_offload"]


@dataclass(frozen=True, kw_only=True)
class SequentialOffloadConfig(TechniqueConfig, technique="sequential offload", name="SEQUENTIAL_OFFLOAD"):
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


class SequentialRootHook(MoveInputsHook):
    technique = Technique.SEQUENTIAL_OFFLOAD


def apply_sequential_cpu_offload(
    module: nn.Module, config: SequentialOffloadConfig | None = None, *, execution_device=None
) -> Handle:
    """Sequentially offload `module` (again: replaces it); the handle's config holds the resolved place.
    `execution_device=` alone is `SequentialOffloadConfig(execution_device=...)`."""
    config = config_with_execution_device(config, SequentialOffloadConfig, execution_device,
                                          function="apply_sequential_cpu_offload")
    place = execution_place(config.execution_device)
    check_compatible(module, SPEC)
    remove_sequential_cpu_offload(module)
    state_dict = {name: tensor.to("cpu") for name, tensor in module.state_dict().items()}
    tied_params = find_tied_parameters(module)
    try:
        root = SequentialRootHook(torch_device(place), io_same_device=True, place=place)
        add_hook_to_module(module, root, append=True)
        serve_weights(module, "", place, state_dict, tied_params_map=None)
        retie_parameters(module, tied_params)
    except BaseException:
        remove_sequential_cpu_offload(module)
        raise
    return Handle(technique=Technique.SEQUENTIAL_OFFLOAD, module=module,
                  config=SequentialOffloadConfig(execution_device=place), remover=remove_sequential_cpu_offload)


def remove_sequential_cpu_offload(module: nn.Module) -> None:
    """Remove the sequential offload hooks; weights come back from the CPU state dict, the module is on the CPU."""
    if remove_hooks_of_type(module, AlignDevicesHook):
        module.to("cpu")


SPEC = register(TechniqueSpec(
    technique=Technique.SEQUENTIAL_OFFLOAD,
    config_class=SequentialOffloadConfig,
    apply=apply_sequential_cpu_offload,
    remove=remove_sequential_cpu_offload,
    refuses={
        Technique.DEVICE_MAP: "",
        Technique.MODEL_OFFLOAD: "",
        Technique.GROUP_OFFLOAD: "",
        Technique.LAYERWISE_CASTING: (
            "sequential offload restores each layer from its own full-precision state dict before the cast hook "
            "runs, so the casting would be bypassed. Use group offloading with offload_type='leaf_level' instead "
            "(it keeps the stored dtype), or model offload"
        ),
    },
    offloads_weights=True,
    editor=device_map_editor,  # its layers' weights are served as a device map's streamed entries are
    gather=served_slots,
))
