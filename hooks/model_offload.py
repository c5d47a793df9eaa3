"""Model offload: whole components move to the accelerator when called; the previous one goes back.

    chain = apply_model_cpu_offload([text_encoder, denoiser, vae], execution_device=0)
    ... run the pipeline ...
    chain.offload_all()            # after a pipeline call: nothing stays on the accelerator

Built on accelerate's `cpu_offload_with_hook` (its `CpuOffload` hook and `UserCpuOffloadHook`): the
components in `chain` (model-graph order) are linked so that calling one offloads its predecessor; the link
is closed into a ring so that the next pipeline call's first component also sends the previous call's last
one back. Components passed as `standalone` (outside the model graph) are offloaded on their own: they move
when called and go back at `offload_all()`.

Components are often entered through a method other than `forward` (a VAE's `decode`): every direct child
of a component carries a `ComponentEntryHook` that runs the component's offload hook first when the
component is not on the execution device yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.hooks import CpuOffload, ModelHook, UserCpuOffloadHook
from torch import nn

from .hook_utils import add_hook_last, hooks_of, remove_hooks_of_type
from .input_moving import move_to_device  # keeps the caller's lists: writes into them stay visible
from .offload_devices import resolve_execution_device
from .techniques import Technique, check_compatible

__all__ = ["ComponentEntryHook", "ModelOffloadChain", "ModelOffloadConfig", "apply_model_cpu_offload", "remove_model_cpu_offload"]


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
        if _weights_device(self.component) != self.execution_device:
            self.offload.hook.pre_forward(self.component)  # offloads the predecessor, moves the component
        return move_to_device(args, self.execution_device), move_to_device(kwargs, self.execution_device)


@dataclass(frozen=True, kw_only=True)
class ModelOffloadConfig:
    execution_device: Any = None  # an accelerator index, "cuda:1", a torch.device; None: the first accelerator


@dataclass(frozen=True, kw_only=True)
class ModelOffloadChain:
    """The offload hooks of one `apply_model_cpu_offload` call, chained ones first, in call order."""

    execution_device: torch.device
    chained: tuple[UserCpuOffloadHook, ...]
    standalone: tuple[UserCpuOffloadHook, ...]

    @property
    def modules(self) -> list[nn.Module]:
        return [hook.model for hook in (*self.chained, *self.standalone)]

    def offload_all(self) -> None:
        """Send every component back to the CPU (what a pipeline does at the end of a call)."""
        for hook in (*self.chained, *self.standalone):
            installed = any(inner is hook.hook for inner in hooks_of(hook.model))  # not removed since
            if installed and _weights_device(hook.model) != torch.device("cpu"):
                hook.offload()

    def remove(self) -> None:
        for module in self.modules:
            remove_model_cpu_offload(module)


def apply_model_cpu_offload(
    chain: Sequence[nn.Module],
    config: ModelOffloadConfig | None = None,
    *,
    standalone: Sequence[nn.Module] = (),
    execution_device=None,
) -> ModelOffloadChain:
    """Model-offload `chain` (in call order) and `standalone` modules. Applying again replaces it.

    `execution_device=` alone is the same as `ModelOffloadConfig(execution_device=...)`."""
    config = config or ModelOffloadConfig(execution_device=execution_device)
    device = resolve_execution_device(config.execution_device)
    modules = [*chain, *standalone]
    for module in modules:
        check_compatible(module, Technique.MODEL_OFFLOAD)
    for module in modules:
        remove_model_cpu_offload(module)
    chained, previous = [], None
    for module in chain:
        previous = _offload(module, device, previous)
        chained.append(previous)
    if len(chained) > 1:
        chained[0].hook.prev_module_hook = chained[-1]  # the ring: a new call sends the last component back
    alone = [_offload(module, device, None) for module in standalone]
    return ModelOffloadChain(execution_device=device, chained=tuple(chained), standalone=tuple(alone))


def remove_model_cpu_offload(module: nn.Module) -> None:
    """Remove the model offload hooks of `module`'s tree; the module is left on the CPU."""
    if remove_hooks_of_type(module, (CpuOffload, ComponentEntryHook)):
        module.to("cpu")


def _offload(module: nn.Module, device: torch.device, previous: UserCpuOffloadHook | None) -> UserCpuOffloadHook:
    # accelerate's cpu_offload_with_hook, with the hook appended by `add_hook_last`: accelerate's append would
    # detach a hook already there (a layerwise-casting hook would cast its weights back to full precision).
    hook = CpuOffload(execution_device=device, prev_module_hook=previous)
    add_hook_last(module, hook)
    user_hook = UserCpuOffloadHook(module, hook)
    for child in module.children():
        add_hook_last(child, ComponentEntryHook(component=module, offload=user_hook))
    return user_hook


def _weights_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")
