"""`VirtualTensor`: a tensor of a virtual accelerator. Its bytes are an ordinary CPU tensor (`_inner`); its
`.device` is the virtual device (`vgpu:k`) it was moved to, in Python and in C++ alike.

It is a wrapper subclass (`__torch_dispatch__`, as torch's FakeTensor is): every aten op on it unwraps the CPU
tensors, checks that the arguments share one device (`rules.common_device`, CUDA's rule and message), runs on the
CPU and wraps the results onto that device (`dispatch.run_on_cpu`). The numbers are therefore exactly those of a
CPU run; only the device bookkeeping is added. A few Python-level calls are answered before dispatch
(`functions.py`: `.data =`, `.tolist()`, `.numpy()`, attention). Factories (`torch.randn(..., device="vgpu:1")`)
and copies from the CPU reach the backend's kernel (`backend.py`), which runs the same `run_on_cpu`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class VirtualTensor(torch.Tensor):
    """A CPU tensor that is, for everything that asks, on virtual accelerator `device.index`."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        # Only reached as `type(param)(value, requires_grad=...)`: accelerate's set_module_tensor_to_device
        # rebuilds a parameter through its class, which for a parameter of a virtual device is this one.
        # nn.Parameter keeps the value's device (a VirtualTensor flagged as a parameter, or a plain CPU one).
        return nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_on_cpu(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return handle_function(func, args, kwargs or {})

    # Python code that asks where the bytes are (safetensors' and accelerate's shared-tensor checks, tied weights)
    # gets the CPU tensor's answer, as it would get the device memory's on a GPU.
    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._inner.untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:
        # torch's printer formats 0-dim subclass tensors with object.__format__ and fails: print the CPU tensor.
        text = repr(self._inner)
        return f"{text[:-1]}, device='{self.device}')" if text.endswith(")") else f"{text} (device='{self.device}')"

    def __format__(self, format_spec: str) -> str:
        return self._inner.__format__(format_spec)

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save) as torch pickles any device tensor: its CPU bytes, restored onto the device (or
        # where `map_location` says), with a rebuild function torch.load(weights_only=True) accepts.
        rebuild = torch._utils._rebuild_device_tensor_from_cpu_tensor
        return rebuild, (self._inner, self.dtype, str(self.device), self.requires_grad)

    def __deepcopy__(self, memo: dict) -> "VirtualTensor":
        # torch's default would copy the storage data_ptr() points at (a CPU one) into this wrapper, and refuse.
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            copied = wrap(self._inner.clone(), self.device)
        copied.requires_grad_(self.requires_grad)
        for key, value in self.__dict__.items():
            if key != "_inner":
                setattr(copied, key, copy.deepcopy(value, memo))  # `_is_param` keeps a parameter a parameter
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = copied
        return copied


def wrap(inner: torch.Tensor, device: torch.device) -> VirtualTensor:
    """`inner` (a CPU tensor) as a tensor of virtual device `device`; they share bytes."""
    wrapper = torch.Tensor._make_wrapper_subclass(
        VirtualTensor, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
        dtype=inner.dtype, layout=inner.layout, device=device, requires_grad=False,
    )
    wrapper._inner = inner
    return wrapper


def unwrap(value):
    return value._inner if isinstance(value, VirtualTensor) else value


def is_virtual(device: torch.device) -> bool:
    return device.type == torch._C._get_privateuse1_backend_name()


def unwrap_argument(value, tensors: list):
    """`value` with VirtualTensors replaced by their CPU tensors; every tensor met is appended to `tensors`.
    aten arguments nest one level at most (Tensor[], Tensor?[]), so no general tree walk is needed."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return value._inner if isinstance(value, VirtualTensor) else value
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(unwrap_argument(item, tensors) for item in value)
    return value


def wrap_result(out, device: torch.device):
    """Every tensor in an op's result (a tensor, or a list/tuple of them) put on `device`."""
    if isinstance(out, torch.Tensor):
        return wrap(out, device)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_result(item, device) for item in out)
    return out


# The handlers use the class above; imported last so that each module can name the other.
from .dispatch import run_on_cpu  # noqa: E402
from .functions import handle_function  # noqa: E402
