"""The code of a split component that runs between its entries, fed its tensors on one device.

A split puts a component's entries (blocks, embedders, heads) on several accelerators, and each entry's hook
moves its inputs to where it runs. The component's own forward also computes between entries, and there it can
meet tensors from two devices, where no entry hook is: SD3's transformer adds the ControlNet's residual (made
before the blocks, on the execution device) to the hidden state a block on GPU 1 returned; a U-Net's up block, not
itself an entry, concatenates the hidden state with a skip connection kept from a down block on another GPU. On
CUDA such an op raises "Expected all tensors to be on the same device".

While a split component's forward runs, `ParentGlue` watches the ops that run outside its entries (a
`TorchFunctionMode`; entries count as inside while their hooks run): an op whose tensors are on two or more
accelerators gets them moved to the first one's device (the hidden state's, in both examples), once per op and
counted by the transfer meter as inputs moved. Inside entries nothing is moved: a mix-up there is a real
placement bug and still raises. CPU tensors are left as they are (a 0-d CPU tensor is a scalar to CUDA; any
other one mixed with a device tensor is an error there too). The cost is a Python check per op of the forward,
about a microsecond each, only for split components.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .input_moving import move_to_device, place_of_device

_GLUE = "_placement_parent_glue"  # the module attribute holding its glue (and marking the wrapped forward)
# Calls that move tensors by design, never rewritten.
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_})


class ParentGlue:
    """Per split component: the mode its forward runs under, and how deep inside its entries the current op is
    (torch's own forward hooks on each entry count it, `always_call`: also when an entry raises)."""

    def __init__(self, entries: list[nn.Module]) -> None:
        self.depth = 0
        self.mode = _GlueMode(self)
        self.handles = []
        for entry in entries:
            self.handles.append(entry.register_forward_pre_hook(self._enter))
            self.handles.append(entry.register_forward_hook(self._leave, always_call=True))

    def run(self, forward, *args, **kwargs):
        self.depth = 0
        with self.mode:
            return forward(*args, **kwargs)

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth = max(self.depth - 1, 0)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _GlueMode(TorchFunctionMode):
    def __init__(self, glue: ParentGlue) -> None:
        super().__init__()
        self.glue = glue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.glue.depth == 0 and func not in _MOVES:
            device = _mixed_accelerators(args, kwargs)
            if device is not None:
                args, kwargs = _to(args, device), _to(kwargs, device)
        return func(*args, **kwargs)


def _tensors(data: Any):
    """The tensors of an op's argument: itself, or those of a list/tuple of them (torch.cat's), as aten takes."""
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, (list, tuple)):
        for item in data:
            if isinstance(item, torch.Tensor):
                yield item


def _mixed_accelerators(args: tuple, kwargs: dict) -> torch.device | None:
    """The first accelerator tensor's device, if the op's tensors are on two or more."""
    first, mixed = None, False
    for value in (*args, *kwargs.values()):
        for tensor in _tensors(value):
            device = tensor.device
            if device.type in ("cpu", "meta"):
                continue
            if first is None:
                first = device
            elif device != first:
                mixed = True
    return first if mixed else None


def _to(data: Any, device: torch.device) -> Any:
    """`data` (an op's args or kwargs) with the accelerator tensors `_tensors` finds on `device`, in new
    containers: the caller's lists stay as they are."""
    if isinstance(data, torch.Tensor):
        return data if data.device.type in ("cpu", "meta") else move_to_device(data, device, place_of_device(device))
    if isinstance(data, dict):
        return {key: _to(item, device) for key, item in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [_to(item, device) for item in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    return data


def glue_parent_forward(module: nn.Module, entries: list[nn.Module]) -> ParentGlue:
    """Run `module.forward` (its hooked forward: call this after the hooks are on) inside a `ParentGlue` that
    leaves the ops of `entries` alone. Removing the module's accelerate hooks restores its original forward, which
    drops this wrapper; `remove_glue` takes the entries' counters off."""
    glue = ParentGlue(entries)
    hooked = module.forward

    @functools.wraps(hooked)
    def forward(*args, **kwargs):
        return glue.run(hooked, *args, **kwargs)

    module.forward = forward
    setattr(module, _GLUE, glue)
    return glue


def glue_of(module: nn.Module) -> ParentGlue | None:
    return getattr(module, _GLUE, None)


def remove_glue(module: nn.Module) -> None:
    """Take the glue off `module` and every submodule holding one (the wrapped forward goes with the hooks)."""
    for submodule in module.modules():
        glue = submodule.__dict__.pop(_GLUE, None)
        if glue is not None:
            glue.remove()


__all__ = ["ParentGlue", "glue_of", "glue_parent_forward", "remove_glue"]
