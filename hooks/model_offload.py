"""Model offload: whole components move to the accelerator when called; the previous one goes back.

    chain = apply_model_cpu_offload([text_encoder, denoiser, vae], ModelOffloadConfig(execution_device=0))
    ... run the pipeline ...
    chain.offload_all()            # after a pipeline call: nothing stays on the accelerator
    chain.remove()                 # the handle: every hook off, the components on the CPU

One calling shape, `apply_model_cpu_offload(module, config) -> handle`, where `module` is one component or
the components of a chain in call order (model offload is a chain: calling one component offloads its
predecessor). The components in the chain are linked so that calling one offloads the one before it; the
link is closed into a ring so that the next pipeline call's first component also sends the previous call's
last one back. Components passed as `standalone` (outside the model graph) are offloaded on their own: they
move when called and go back at `offload_all()`.

Built on accelerate's `CpuOffload` hook and `UserCpuOffloadHook`; our `ModelOffloadHook` keeps whether its
component is on the execution device itself (on plain-CPU virtual accelerators its weights never leave the CPU) and
counts each move to the accelerator with the transfer meter. Components are often entered through a method
other than `forward` (a VAE's `decode`): every direct child of a component carries a `ComponentEntryHook`
that runs the component's offload hook first when the component is not on the execution device yet.
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
from .techniques import Technique, TechniqueSpec, check_compatible, register

__all__ = ["SPEC", "ComponentEntryHook", "ModelOffloadChain", "ModelOffloadConfig", "ModelOffloadHook",
           "apply_model_cpu_offload", "remove_model_cpu_offload"]


class ModelOffloadHook(CpuOffload):
    """accelerate's `CpuOffload`, knowing whether its component is on the execution device (`onloaded`)
    rather than reading a weight's device, and counting each onload as weights moved to `place`."""

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
        moved = move_to_device(args, self.execution_device, self.place), move_to_device(
            kwargs, self.execution_device, self.place)
        self._entered = meter.enter_place(self.place)
        return moved

    def post_forward(self, module, output):
        if self._entered:
            meter.leave_place(self.place)
            self._entered = False
        return return_to_caller(output, None, source=self.place, target=None)


class ComponentEntryHook(ModelHook):
    """On a direct child of an offloaded component: bring the component over if it is entered here first."""

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
        return move_to_device(args, self.execution_device, hook.place), move_to_device(
            kwargs, self.execution_device, hook.place)


@dataclass(frozen=True, kw_only=True)
class ModelOffloadConfig:
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


@dataclass(frozen=True, kw_only=True)
class ModelOffloadChain:
    """The handle of one `apply_model_cpu_offload` call: its offload hooks, chained ones first, in call order."""

    config: ModelOffloadConfig  # as resolved: execution_device is a place (an accelerator index or "cpu")
    execution_device: torch.device
    chained: tuple[UserCpuOffloadHook, ...]
    standalone: tuple[UserCpuOffloadHook, ...]
    technique = Technique.MODEL_OFFLOAD

    @property
    def modules(self) -> list[nn.Module]:
        return [hook.model for hook in (*self.chained, *self.standalone)]

    def offload_all(self) -> None:
        """Send every component back to the CPU (what a pipeline does at the end of a call)."""
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
    """Model-offload `module` (one component, or a chain of them in call order) and `standalone` modules.
    Applying again replaces it.

    `execution_device=` alone is the same as `ModelOffloadConfig(execution_device=...)`."""
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
