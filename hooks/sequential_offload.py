"""Sequential offload: every layer's weights stay in CPU RAM and visit the accelerator only while it runs.

    handle = apply_sequential_cpu_offload(denoiser, SequentialOffloadConfig(execution_device=0))
    apply_sequential_cpu_offload(denoiser, execution_device=0)   # the same, diffusers' spelling
    handle.remove()                                              # or remove_sequential_cpu_offload(denoiser)

This is accelerate's `cpu_offload` (an `AlignDevicesHook` per module holding tensors, weights read from a
CPU state dict per call, `meta` placeholders in between), with the weight-serving hooks of `dispatch` (which
move inputs without copying the caller's lists and count what they serve). It needs the least accelerator
memory and is by far the slowest technique: each layer waits for its own synchronous copy (see
docs/memory.md for the measured ratio); group offloading with `offload_type="leaf_level", use_stream=True`
saves as much and overlaps the copies with compute.
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
from .techniques import Handle, Technique, TechniqueSpec, check_compatible, register

__all__ = ["SPEC", "SequentialOffloadConfig", "apply_sequential_cpu_offload", "remove_sequential_cpu_offload"]


@dataclass(frozen=True, kw_only=True)
class SequentialOffloadConfig:
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


class SequentialRootHook(MoveInputsHook):
    """At the root: inputs to the execution device, outputs back to the caller's (accelerate's root hook)."""

    technique = Technique.SEQUENTIAL_OFFLOAD


def apply_sequential_cpu_offload(
    module: nn.Module, config: SequentialOffloadConfig | None = None, *, execution_device=None
) -> Handle:
    """Sequentially offload `module`; applying again replaces it. The handle's config names the execution
    device as resolved (`handle.config.execution_device`, a place: an accelerator index or "cpu").

    `execution_device=` alone is the same as `SequentialOffloadConfig(execution_device=...)`."""
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
