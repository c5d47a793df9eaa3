"""Move a module's inputs to the device it executes on without copying what is already there.

accelerate's `send_to_device` rebuilds every list, tuple and dict it walks, so a module that writes into a list
argument (Wan's VAE cache: `feat_cache[idx] = x`) writes into a copy the caller never sees. `move_to_device`
updates lists and dicts in place, rebuilds a tuple only when an entry moved, and leaves other objects to
`send_to_device`. A *place* is the plan's spelling of a device (accelerator index, "cpu"): under non-strict
virtual accelerators the torch device is the CPU and only the place says a copy crosses the bus (for the meter).

A split component's own forward computes between its entries and can meet tensors from two accelerators there
(SD3's ControlNet residual, a U-Net's skip connections): `ParentGlue` watches the ops outside entries and moves
mixed accelerator tensors to the first one's device, about a microsecond per op, only for split components.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.hooks import AlignDevicesHook, ModelHook
from accelerate.utils import send_to_device
from torch import nn
from torch.overrides import TorchFunctionMode

from placement.devices import Device, accelerators_present, normalize_device, torch_device
from placement.errors import InvalidDeviceError

from . import transfer_meter as meter
from .errors import OffloadConfigError
from .transfer_meter import place_of_device


def move_to_device(data: Any, device: torch.device, place: Device | None = None) -> Any:
    """`data` with every tensor on `device`, the caller's lists and dicts kept; with `place`, each tensor not
    there yet is counted as an input moved there. A `torch.device` argument naming another accelerator of the
    same kind names `device` instead: the module makes its tensors where it runs (Mochi's transformer passes its
    own device to its RoPE, which builds positions there and meets its frequencies, moved here)."""
    if isinstance(data, torch.device):
        return device if data.type == device.type and data.type not in ("cpu", "meta") else data
    if isinstance(data, torch.Tensor):
        if place is not None and meter.metering():
            data = _count_input(data, place)
        return data if is_on(data, device) else data.to(device)
    if isinstance(data, (list, dict)):  # updated in place: a write the module makes into it is the caller's
        for key, item in list(data.items() if isinstance(data, dict) else enumerate(data)):
            moved = move_to_device(item, device, place)
            if moved is not item:
                data[key] = moved
        return data
    if isinstance(data, tuple):
        moved = [move_to_device(item, device, place) for item in data]
        if all(new is old for new, old in zip(moved, data)):
            return data
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    if hasattr(data, "to") and not isinstance(data, (nn.Module, str, bytes)):
        return send_to_device(data, device)
    return data


def _count_input(tensor: torch.Tensor, place: Device) -> torch.Tensor:
    source = meter.place_of(tensor)
    if source == place:
        return tensor
    meter.record(meter.Payload.INPUTS, meter.tensor_bytes(tensor), source=source, target=place)
    # Virtual accelerators: the caller keeps its tensor where its tag says; the module gets an untagged alias,
    # which is where the module runs (no byte is copied: the alias shares the storage).
    return tensor.view_as(tensor) if meter.is_tagged(tensor) else tensor


def return_to_caller(output: Any, device: torch.device | None, *, source: Device, target: Device | None) -> Any:
    """Outputs computed on `source`, moved to the caller's `device` (None: left there), counted as inputs moved
    to `target` (the caller's place) and tagged there for the next hook."""
    if meter.metering() and target is not None:
        tracking = meter.tracking_places()
        for tensor in _tensors(output):
            origin = source if tracking else meter.place_of(tensor)  # a split module's last entry may be there
            meter.record(meter.Payload.INPUTS, meter.tensor_bytes(tensor), source=origin, target=target)
    if device is not None:
        output = move_to_device(output, device)
    if meter.metering():
        for tensor in _tensors(output):
            meter.tag(tensor, source if target is None else target)
    return output


def _tensors(data: Any):
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, Mapping):  # dicts, and model outputs (ordered dicts of tensors)
        for item in data.values():
            yield from _tensors(item)
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from _tensors(item)


def is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """`tensor` is on `device` ("mps" and "mps:0" are one device: an index-less device matches any index)."""
    here = tensor.device
    return here.type == device.type and (device.index is None or here.index == device.index)


class MoveInputsHook(AlignDevicesHook):
    """Move the forward's inputs to `execution_device` (with `io_same_device`, outputs back); weights are not
    touched. An `AlignDevicesHook`, so the other techniques recognise a dispatched module by it."""

    def __init__(self, execution_device: torch.device, *, io_same_device: bool = False,
                 place: Device | None = None) -> None:
        super().__init__(execution_device=torch.device(execution_device), io_same_device=io_same_device)
        self.place = place_of_device(self.execution_device) if place is None else place
        self.input_place: Device | None = None
        self._entered = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(execution_device={self.execution_device}, place={self.place!r}, "
                f"io_same_device={self.io_same_device})")

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module  # the loader already put the weights on the execution device

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        if self.io_same_device:
            first = first_tensor([args, kwargs])
            self.input_device = None if first is None else first.device
            self.input_place = None if first is None or not meter.metering() else meter.place_of(first)
        moved = move_to_device((args, kwargs), self.execution_device, self.place)
        self._entered = meter.enter_place(self.place)
        return moved

    def post_forward(self, module: nn.Module, output):
        if self._entered:
            meter.leave_place(self.place)
            self._entered = False
        if self.io_same_device and self.input_device is not None:
            return return_to_caller(output, self.input_device, source=self.place, target=self.input_place)
        return return_to_caller(output, None, source=self.place, target=None)


def first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in `data` (positional arguments first), as accelerate's `find_device` looks."""
    return next(_tensors(data), None)


class ReturnOutputsHook(ModelHook):
    """Outputs back to the device the first input came from, for a runtime whose top hook leaves them where
    the module ran (group offloading). Install it first, to see the inputs before the next hook moves them."""

    def __init__(self) -> None:
        super().__init__()
        self.input_device: torch.device | None = None

    def __repr__(self) -> str:
        return "ReturnOutputsHook()"

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        first = first_tensor([args, kwargs])
        self.input_device = None if first is None else first.device
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        return output if self.input_device is None else move_to_device(output, self.input_device)


class DeliverOutputsHook(ModelHook):
    """Hand a module's outputs over on `device`, where its caller joins them with another module's."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"DeliverOutputsHook(device={self.device})"

    def post_forward(self, module: nn.Module, output):
        return move_to_device(output, self.device)


# Methods other than forward through which callers enter a module (diffusers' and our VAEs: encode, decode).
ENTRY_METHODS = ("encode", "decode")
_WRAPPED = "_placement_entry_methods"


def move_inputs_of_entry_methods(module: nn.Module, device: torch.device, *, place: Device | None = None,
                                 phase=None) -> None:
    """Make `module.encode(...)` / `module.decode(...)` move their inputs to `device` as the top hook does for
    `forward` (a hook wraps `forward` only); with `phase` (`enter()` / `exit()`) the call is also a run."""
    device = torch.device(device)
    place = place_of_device(device) if place is None else place
    _wrap_entry_methods(module, lambda method: _moving(method, device, place, phase))


def run_entry_methods_through(module: nn.Module, hook, *, nested) -> None:
    """Make `module.encode(...)` / `module.decode(...)` run through `hook` as `forward` does, unless `nested()`
    says a run of the module is already going on (a forward calling its own encode)."""
    _wrap_entry_methods(module, lambda method: _through(module, method, hook, nested))


def _wrap_entry_methods(module: nn.Module, wrap) -> None:
    """Instance attributes (the class is untouched) that `restore_entry_methods` drops."""
    wrapped = []
    for name in ENTRY_METHODS:
        method = getattr(module, name, None)
        if callable(method) and name not in module.__dict__:
            setattr(module, name, wrap(method))
            wrapped.append(name)
    if wrapped:
        setattr(module, _WRAPPED, tuple(wrapped))


def _through(module: nn.Module, method, hook, nested):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if nested():
            return method(*args, **kwargs)
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            hook.post_forward(module, None)
            raise
        return hook.post_forward(module, output)

    return wrapper


def restore_entry_methods(module: nn.Module) -> None:
    """Drop the entry-method wrappers installed on `module` and its submodules."""
    for submodule in module.modules():
        for name in submodule.__dict__.pop(_WRAPPED, ()):
            submodule.__dict__.pop(name, None)


def _moving(method, device: torch.device, place: Device, phase):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if phase is not None:
            phase.enter()
        try:
            args, kwargs = move_to_device((args, kwargs), device, place)
            entered = meter.enter_place(place)
            try:
                output = method(*args, **kwargs)
            finally:
                if entered:
                    meter.leave_place(place)
            return return_to_caller(output, None, source=place, target=None)
        finally:
            if phase is not None:
                phase.exit()

    return wrapper


def execution_place(device=None) -> Device:
    """`device` as a place that can execute; None: accelerator 0, or the CPU (which still runs every hook)."""
    if device is None:
        return 0 if accelerators_present() else "cpu"
    try:
        place = normalize_device(device)
        resolved = torch_device(place)  # "disk" is refused there: it cannot execute
    except InvalidDeviceError as error:
        raise OffloadConfigError(f"Execution device {device!r} is not usable: {error}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise OffloadConfigError(
            f"Execution device {device!r} needs CUDA, which this machine does not have; pass device=None "
            "(the CPU then executes) or run on a GPU machine."
        )
    return place


def resolve_execution_device(device=None) -> torch.device:
    """`execution_place(device)` as the torch device that computes there."""
    return torch_device(execution_place(device))


def config_with_execution_device(config: Any, config_class: type, execution_device: Any, *, function: str) -> Any:
    """`config`, or `config_class(execution_device=...)` for the keyword spelling; both is an error."""
    if config is None:
        return config_class(execution_device=execution_device)
    if execution_device is not None:
        raise OffloadConfigError(f"{function}: pass a {config_class.__name__} or execution_device=, not both.")
    if not isinstance(config, config_class):
        raise OffloadConfigError(f"{function}: expected a {config_class.__name__}, got {type(config).__name__}.")
    return config


_GLUE = "_placement_parent_glue"  # the module attribute holding its glue (and marking the wrapped forward)
# Calls that move tensors by design, never rewritten.
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_})


class ParentGlue:
    """Per split component: the mode its forward runs under, and how deep inside its entries the current op is
    (torch forward hooks count it, `always_call`: also when an entry raises)."""

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


def _op_tensors(data: Any):
    """The tensors of an op's argument: itself, or those of a list/tuple of them (torch.cat's)."""
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
        for tensor in _op_tensors(value):
            device = tensor.device
            if device.type in ("cpu", "meta"):
                continue
            if first is None:
                first = device
            elif device != first:
                mixed = True
    return first if mixed else None


def _to(data: Any, device: torch.device) -> Any:
    """`data` (an op's args or kwargs) with its accelerator tensors on `device`, in new containers."""
    if isinstance(data, torch.Tensor):
        return data if data.device.type in ("cpu", "meta") else move_to_device(data, device, place_of_device(device))
    if isinstance(data, dict):
        return {key: _to(item, device) for key, item in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [_to(item, device) for item in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    return data


def glue_parent_forward(module: nn.Module, entries: list[nn.Module]) -> ParentGlue:
    """Run `module.forward` (hooked: call this after the hooks are on) inside a `ParentGlue` that leaves the ops
    of `entries` alone; removing the accelerate hooks drops the wrapper, `remove_glue` the entries' counters."""
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
    for submodule in module.modules():
        glue = submodule.__dict__.pop(_GLUE, None)
        if glue is not None:
            glue.remove()


__all__ = ["DeliverOutputsHook", "ENTRY_METHODS", "MoveInputsHook", "ParentGlue", "ReturnOutputsHook",
           "config_with_execution_device", "execution_place", "first_tensor", "glue_of",
           "glue_parent_forward", "is_on", "move_inputs_of_entry_methods", "move_to_device", "remove_glue",
           "resolve_execution_device", "restore_entry_methods", "return_to_caller", "run_entry_methods_through"]
