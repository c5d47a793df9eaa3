"""Model offload: whole components move to the accelerator when called; the previous one goes back.

    chain = apply_model_cpu_offload([text_encoder, denoiser, vae], ModelOffloadConfig(execution_device=0))
    chain.offload_all()            # after a pipeline call: nothing stays on the accelerator

accelerate's `CpuOffload` / `UserCpuOffloadHook` chain, closed into a ring so the next call's first component
sends the last one back. Our hook knows whether its component is onloaded itself (plain-CPU virtual accelerators
never move weights) and meters each move; every direct child carries a `ComponentEntryHook`, as components are
often entered through another method than `forward` (a VAE's `decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.hooks import CpuOffload, ModelHook, UserCpuOffloadHook
from accelerate.utils.memory import clear_device_cache
from torch import nn

from placement.devices import Device, torch_device

from . import transfer_meter as meter
from .hook_utils import add_hook_last, hooks_of, remove_hooks_of_type
from .input_moving import config_with_execution_device, execution_place
from .input_moving import move_to_device, return_to_caller  # keeps the caller's lists: writes stay visible
from .techniques import Technique, TechniqueConfig, TechniqueSpec, check_compatible, register

__all__ = ["SPEC", "ComponentEntryHook", "ModelOffloadChain", "ModelOffloadConfig", "ModelOffloadHook",
           "apply_model_cpu_offload", "remove_model_cpu_offload"]


class ModelOffloadHook(CpuOffload):
    """accelerate's `CpuOffload`, knowing whether its component is onloaded rather than reading a weight's device."""

    technique = Technique.MODEL_OFFLOAD

    def __init__(self, *, place: Device, prev_module_hook: UserCpuOffloadHook | None) -> None:
        super().__init__(execution_device=torch_device(place), prev_module_hook=prev_module_hook)
        self.place = place
        self.onloaded = False
        self._entered = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.onloaded = False  # accelerate calls this to offload (UserCpuOffloadHook.offload)
        return module.to("cpu")

    def onload(self, module: nn.Module) -> None:
        """Send the previous component back if it is on the device, then bring this one over."""
        previous = self.prev_module_hook
        if previous is not None and previous.hook is not self and previous.hook.onloaded:
            previous.offload()
            clear_device_cache()
        if not self.onloaded:
            if meter.metering():
                meter.record(meter.Payload.WEIGHTS, _module_bytes(module), source="cpu", target=self.place)
            module.to(self.execution_device)
            self.onloaded = True

    def pre_forward(self, module, *args, **kwargs):
        self.onload(module)
        moved = move_to_device((args, kwargs), self.execution_device, self.place)
        self._entered = meter.enter_place(self.place)
        return moved

    def post_forward(self, module, output):
        if self._entered:
            meter.leave_place(self.place)
            self._entered = False
        return return_to_caller(output, None, source=self.place, target=None)


class ComponentEntryHook(ModelHook):
    technique = Technique.MODEL_OFFLOAD

    def __init__(self, *, component: nn.Module, offload: UserCpuOffloadHook) -> None:
        self.component = component
        self.offload = offload

    @property
    def execution_device(self) -> torch.device:
        return self.offload.hook.execution_device

    def pre_forward(self, module, *args, **kwargs):
        hook = self.offload.hook
        if not hook.onloaded:
            hook.onload(self.component)  # offloads the predecessor, moves the component
        return move_to_device((args, kwargs), self.execution_device, hook.place)


@dataclass(frozen=True, kw_only=True)
class ModelOffloadConfig(TechniqueConfig, technique="model offload", name="MODEL_OFFLOAD"):
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


@dataclass(frozen=True, kw_only=True)
class ModelOffloadChain:
    """The handle of `apply_model_cpu_offload`: its offload hooks, chained ones first, in call order."""

    config: ModelOffloadConfig  # as resolved: execution_device is a place (an accelerator index or "cpu")
    execution_device: torch.device
    chained: tuple[UserCpuOffloadHook, ...]
    standalone: tuple[UserCpuOffloadHook, ...]
    technique = Technique.MODEL_OFFLOAD

    @property
    def modules(self) -> list[nn.Module]:
        return [hook.model for hook in (*self.chained, *self.standalone)]

    def offload_all(self) -> None:
        for hook in (*self.chained, *self.standalone):
            installed = any(inner is hook.hook for inner in hooks_of(hook.model))  # not removed since
            if installed and hook.hook.onloaded:
                hook.offload()

    def remove(self) -> None:
        for module in self.modules:
            remove_model_cpu_offload(module)


def apply_model_cpu_offload(
    module: nn.Module | Sequence[nn.Module],
    config: ModelOffloadConfig | None = None,
    *,
    standalone: Sequence[nn.Module] = (),
    execution_device=None,
) -> ModelOffloadChain:
    """Model-offload `module` (one component, or a chain in call order) and `standalone` ones, offloaded on their
    own (again: replaces it). `execution_device=` alone is `ModelOffloadConfig(execution_device=...)`."""
    config = config_with_execution_device(config, ModelOffloadConfig, execution_device,
                                          function="apply_model_cpu_offload")
    place = execution_place(config.execution_device)
    chain = [module] if isinstance(module, nn.Module) else list(module)
    modules = [*chain, *standalone]
    for each in modules:
        check_compatible(each, SPEC)
    for each in modules:
        remove_model_cpu_offload(each)
    chained, previous = [], None
    for each in chain:
        previous = _offload(each, place, previous)
        chained.append(previous)
    if len(chained) > 1:
        chained[0].hook.prev_module_hook = chained[-1]  # the ring: a new call sends the last component back
    alone = [_offload(each, place, None) for each in standalone]
    return ModelOffloadChain(config=ModelOffloadConfig(execution_device=place), execution_device=torch_device(place),
                             chained=tuple(chained), standalone=tuple(alone))


def remove_model_cpu_offload(module: nn.Module) -> None:
    """Remove the model offload hooks of `module`'s tree; the module is left on the CPU."""
    if remove_hooks_of_type(module, (CpuOffload, ComponentEntryHook)):
        module.to("cpu")


def _offload(module: nn.Module, place: Device, previous: UserCpuOffloadHook | None) -> UserCpuOffloadHook:
    # accelerate's cpu_offload_with_hook, with the hook appended by `add_hook_last`: accelerate's append would
    # detach a hook already there (a layerwise-casting hook would cast its weights back to full precision).
    hook = ModelOffloadHook(place=place, prev_module_hook=previous)
    add_hook_last(module, hook)
    user_hook = UserCpuOffloadHook(module, hook)
    for child in module.children():
        add_hook_last(child, ComponentEntryHook(component=module, offload=user_hook))
    return user_hook


def _module_bytes(module: nn.Module) -> int:
    distinct = {id(tensor): tensor for tensor in (*module.parameters(), *module.buffers())}
    return sum(meter.tensor_bytes(tensor) for tensor in distinct.values())


SPEC = register(TechniqueSpec(
    technique=Technique.MODEL_OFFLOAD,
    config_class=ModelOffloadConfig,
    apply=apply_model_cpu_offload,
    remove=remove_model_cpu_offload,
    refuses={Technique.DEVICE_MAP: "", Technique.SEQUENTIAL_OFFLOAD: "", Technique.GROUP_OFFLOAD: ""},
    offloads_weights=True,
))
