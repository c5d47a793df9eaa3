"""Strict virtual accelerators (`PLACEMENT_VIRTUAL_ACCELERATORS=N`): N `vgpu` devices torch tells apart.

A `VirtualTensor` keeps its bytes in a CPU tensor and runs every op there, so results are a CPU run's; an op that
mixes devices raises CUDA's error, so a CPU test fails where a multi-GPU run would. The device type is torch's
PrivateUse1 backend renamed `vgpu`; `torch.vgpu.is_available()` is False, so libraries asking `torch.accelerator`
still see a CPU machine. `placement.devices.torch_device` is the one place that hands these devices out.
"""

from __future__ import annotations

import copy
import functools
import threading
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import return_and_correct_aliasing

from .errors import InvalidDeviceError
from .virtual_autocast import register_autocast_kernels

aten = torch.ops.aten

# Ops whose index arguments may stay on the CPU next to a device tensor (CUDA moves them itself).
CPU_INDICES_ALLOWED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                                 aten._unsafe_index, aten._unsafe_index_put})


def common_device(func, tensors: Sequence[torch.Tensor], *, cpu_indices: Sequence[torch.Tensor] = ()) -> torch.device:
    """The one device of `tensors` (CPU scalars and `cpu_indices` aside), else CUDA's RuntimeError naming two."""
    allowed = {id(tensor) for tensor in cpu_indices}
    found: torch.device | None = None
    for tensor in tensors:
        device = tensor.device
        if device.type == "cpu" and (tensor.dim() == 0 or id(tensor) in allowed):
            continue
        if found is None:
            found = device
        elif device != found:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{found} and {device}! (in {func}, on virtual accelerators: PLACEMENT_VIRTUAL_ACCELERATORS)"
            )
    return torch.device("cpu") if found is None else found  # only CPU scalars: the result stays on the CPU


def check_generator(func, generator, device: torch.device) -> None:
    """A random op on `device` needs a generator of that device type, as on CUDA."""
    if generator is not None and generator.device.type != device.type:
        raise RuntimeError(
            f"Expected a '{device.type}' device type for generator but found '{generator.device.type}' (in {func}, "
            "on virtual accelerators: draw on the generator's device and move the result)"
        )


class VirtualTensor(torch.Tensor):
    """A CPU tensor that is, for everything that asks, on virtual accelerator `device.index`."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        # Only reached as `type(param)(value, requires_grad=...)`: accelerate rebuilds a parameter through its class.
        return nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_on_cpu(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if any(not issubclass(kind, VirtualTensor) for kind in types):
            # Another subclass (torchao's Int8Tensor) handles it first, as on CUDA where it is the only one.
            return NotImplemented
        return handle_function(func, args, kwargs or {})

    # Shared-tensor checks (safetensors, accelerate, tied weights) see the CPU bytes, as they would the GPU's.
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
        # As torch pickles any device tensor, with a rebuild torch.load(weights_only=True) accepts.
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


def wrap(inner: torch.Tensor, device: torch.device, *, requires_grad: bool = False) -> VirtualTensor:
    wrapper = torch.Tensor._make_wrapper_subclass(
        VirtualTensor, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
        dtype=inner.dtype, layout=inner.layout, device=device, requires_grad=requires_grad,
    )
    wrapper._inner = inner
    return wrapper


def unwrap(value):
    return value._inner if isinstance(value, VirtualTensor) else value


def is_virtual(device: torch.device) -> bool:
    return device.type == torch._C._get_privateuse1_backend_name()


def unwrap_argument(value, tensors: list):
    """`value` with VirtualTensors unwrapped, each tensor met appended to `tensors` (aten nests one level)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return value._inner if isinstance(value, VirtualTensor) else value
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(unwrap_argument(item, tensors) for item in value)
    return value


def wrap_result(out, device: torch.device, *, requires_grad: bool = False):
    if isinstance(out, torch.Tensor):
        return wrap(out, device, requires_grad=requires_grad)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_result(item, device, requires_grad=requires_grad) for item in out)
    return out


# Composite ops whose decomposition depends on the device type: run whole on the CPU tensors.
RUN_WHOLE = frozenset({aten.scaled_dot_product_attention})


def run_on_cpu(func, args: tuple, kwargs: dict):
    packet = func.overloadpacket
    special = _SPECIAL.get(packet)
    if special is not None:
        return special(func, args, kwargs)
    if packet not in RUN_WHOLE and _is_composite(func):
        # Under inference_mode composite ops reach here whole: decompose them through their C++ kernel, as
        # autograd mode does (`func.decompose` may pick torch._decomp's Python ones, which sum in another order).
        return func._op_dk(_COMPOSITE_KEY, *args, **kwargs)
    inner_args, inner_kwargs, tensors = _unwrap_all(args, kwargs)
    cpu_indices = args[1] if packet in CPU_INDICES_ALLOWED and len(args) > 1 else ()
    device = common_device(func, tensors, cpu_indices=[index for index in cpu_indices if index is not None])
    requested = kwargs.get("device")
    target = torch.device(requested) if requested is not None else device
    if "generator" in kwargs:
        check_generator(func, kwargs["generator"], target)
    if requested is not None and is_virtual(target):
        inner_kwargs["device"] = torch.device("cpu")
    out = func(*inner_args, **inner_kwargs)
    _check_out_sizes(func, kwargs.get("out"))
    if is_virtual(target):
        out = wrap_result(out, target, requires_grad=_view_requires_grad(func, args))
    return return_and_correct_aliasing(func, args, kwargs, out)


def _check_out_sizes(func, out) -> None:
    """A wrapper's sizes are fixed when it is made, so an `out=` tensor the op resized is refused, not left wrong."""
    for tensor in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(tensor, VirtualTensor) and tensor.shape != tensor._inner.shape:
            raise RuntimeError(
                f"{func}: an out= tensor of shape {list(tensor.shape)} on {tensor.device} cannot be resized on "
                f"virtual accelerators to the result of shape {list(tensor._inner.shape)}: give out= the result's "
                "shape, or run with PLACEMENT_VIRTUAL_STRICT=0"
            )


def _view_requires_grad(func, args: tuple) -> bool:
    """A view of a tensor that requires grad requires grad, as autograd makes it on the CPU: under inference_mode
    nothing else says so, and matmul sums in another order by that flag (of `weight.t()`)."""
    return (torch.is_inference_mode_enabled() and func.is_view and isinstance(args[0], torch.Tensor)
            and args[0].requires_grad)


_COMPOSITE_KEY = torch._C.DispatchKey.CompositeImplicitAutograd


def _is_composite(func) -> bool:
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE_KEY)
    return known


_COMPOSITE: dict = {}


def _copy_into(destination, source, *args, **kwargs):
    """Copies cross devices by design: they are how bytes move (the destination keeps its device)."""
    unwrap(destination).copy_(unwrap(source), *args, **kwargs)
    return destination


def _pin_memory(func, args, kwargs):
    raise RuntimeError(f"cannot pin a {args[0].device} tensor: only dense CPU tensors can be pinned")


def compatible_shallow_copy_type(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """CUDA's answer (PrivateUse1 would get no): `Module.to()` then assigns `param.data`, so tied weights (T5's
    `shared` and `encoder.embed_tokens`) stay one tensor across a move, as on CUDA."""
    return tensor.layout == other.layout == torch.strided


_SPECIAL = {
    aten.copy_: lambda func, args, kwargs: _copy_into(*args, **kwargs),
    aten._copy_from: lambda func, args, kwargs: _copy_into(args[1], args[0]),
    aten._copy_from_and_resize: lambda func, args, kwargs: _copy_into(args[1], args[0]),
    aten.is_pinned: lambda func, args, kwargs: False,
    aten._pin_memory: _pin_memory,
    # Composite, so autograd mode answers it at the AutogradPrivateUse1 key (backend.py); inference_mode here.
    aten._has_compatible_shallow_copy_type: lambda func, args, kwargs: compatible_shallow_copy_type(*args),
}


_DATA = torch._C.TensorBase.__dict__["data"]  # the `tensor.data` descriptor
# Its composite kernel picks the fused kernel on the CPU and the math one elsewhere: decomposing it would differ.
RUN_WHOLE_WITHOUT_AUTOGRAD = frozenset({F.scaled_dot_product_attention})


def _unwrap_all(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    inner_args = tuple(unwrap_argument(value, tensors) for value in args)
    inner_kwargs = {key: unwrap_argument(value, tensors) for key, value in kwargs.items()}
    return inner_args, inner_kwargs, tensors


def handle_function(func, args: tuple, kwargs: dict):
    """Python-level calls answered before aten dispatch; the rest run without converting results to this class."""
    if getattr(func, "__self__", None) in (_DATA, DATA_PROPERTY) and func.__name__ == "__set__":
        return set_data(*args)
    if func is torch.Tensor.tolist:  # torch refuses it for subclasses; CUDA tensors answer it
        return args[0]._inner.tolist()
    if func is torch.Tensor.numpy:
        raise TypeError(f"can't convert {args[0].device} device type tensor to numpy. Use Tensor.cpu() to copy "
                        "the tensor to host memory first.")
    if func in RUN_WHOLE_WITHOUT_AUTOGRAD:
        inner_args, inner_kwargs, tensors = _unwrap_all(args, kwargs)
        if not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)):
            device = common_device(func, tensors)
            out = func(*inner_args, **inner_kwargs)
            return wrap_result(out, device) if is_virtual(device) else out
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def set_data(target: VirtualTensor, value: torch.Tensor) -> None:
    """`target.data = value` on a virtual tensor, as on a GPU: the object stays, its contents and device change."""
    if isinstance(value, VirtualTensor):
        with torch._C.DisableTorchFunctionSubclass():
            _DATA.__set__(target, value)  # sizes, strides, dtype and device of the wrapper
        target._inner = value._inner
        return
    swap_into(target, value)  # to the CPU the two tensor types differ


def swap_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.data = value` across tensor types (CPU and virtual): the object is kept (ids, module slots), with
    its requires_grad, parameter-ness and attributes."""
    replacement = value.detach()
    if isinstance(target, nn.Parameter):
        replacement = nn.Parameter(replacement, requires_grad=target.requires_grad)
    else:
        replacement.requires_grad_(target.requires_grad)
    extra = {key: item for key, item in target.__dict__.items() if key not in ("_inner", "_is_param")}
    replacement.__dict__.update(extra)
    try:
        torch.utils.swap_tensors(target, replacement)
    except RuntimeError as error:  # torch's words name neither the assignment nor the way out
        raise RuntimeError(
            f"`tensor.data = value` from {target.device} to {value.device} swaps the tensor object (the two "
            f"tensor types differ on virtual accelerators), which torch refuses here: {error}. Usually an "
            "autograd graph still holds the tensor: assign under torch.no_grad() after that graph is gone, or "
            "run with PLACEMENT_VIRTUAL_STRICT=0."
        ) from error


def _get_data(tensor: torch.Tensor) -> torch.Tensor:
    return _DATA.__get__(tensor, type(tensor))


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    # torch's setter asks only the target for __torch_function__, and C++ set_data refuses two tensor types; on
    # CUDA the assignment moves the tensor (diffusers' group offloading onloads that way).
    if isinstance(value, VirtualTensor) and not isinstance(tensor, VirtualTensor):
        swap_into(tensor, value)
    else:
        _DATA.__set__(tensor, value)  # torch's own, __torch_function__ of the target's class included


# `torch.Tensor.data` once `ensure_backend` ran: torch's descriptor plus the one assignment it cannot route.
DATA_PROPERTY = property(_get_data, _set_data, doc=_DATA.__doc__)


BACKEND_NAME = "vgpu"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "library": the torch.library.Library objects holding the kernels (kept alive)


def ensure_backend() -> None:
    """Register the `vgpu` device type with torch, once (its one kernel is a boxed fallback to `run_on_cpu`)."""
    if "library" in _STATE:
        return
    with _LOCK:
        if "library" in _STATE:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", BACKEND_NAME):
            raise InvalidDeviceError(
                f"Strict virtual accelerators need torch's PrivateUse1 backend, which is already the {current!r} "
                "device here. Set PLACEMENT_VIRTUAL_STRICT=0 to run the virtual accelerators on the plain CPU."
            )
        if current == "privateuseone":
            _register_device_type()
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_backend_kernel, "PrivateUse1")
        # The ops `torch.tensor(data, device=...)` reaches with Python dispatch off get kernels of their own: the
        # boxed fallback cannot be entered from there (torch asserts), a per-op Python kernel can.
        kernels = torch.library.Library("aten", "IMPL", "PrivateUse1")
        for name in _DIRECT_KERNELS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet), overload or "default")
            kernels.impl(name, functools.partial(_backend_kernel, op))
        # Answered before its composite kernel, which tells PrivateUse1 "no" where CUDA gets "yes".
        autograd = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
        autograd.impl("_has_compatible_shallow_copy_type", compatible_shallow_copy_type)
        torch.Tensor.data = DATA_PROPERTY  # `cpu_tensor.data = virtual_tensor`, as CUDA allows (tensor.py)
        _STATE["library"] = (fallback, kernels, autograd, *register_autocast_kernels())


def _register_device_type() -> None:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=BACKEND_NAME, backend_module=_device_module())


def _device_module() -> types.ModuleType:
    """`torch.vgpu`: what torch's generic device code calls (seeding, synchronize, empty_cache): no-ops."""
    module = types.ModuleType(f"torch.{BACKEND_NAME}")
    answers = {"is_available": False, "is_initialized": True, "device_count": 0, "current_device": 0,
               "_is_in_bad_fork": False, "manual_seed": None, "manual_seed_all": None, "synchronize": None,
               "empty_cache": None}
    for name, answer in answers.items():
        setattr(module, name, lambda *args, answer=answer, **kwargs: answer)
    # torch.autocast asks a PrivateUse1 backend which lower precisions it takes: CUDA's two. A model that opens
    # `torch.autocast(x.device.type, ...)` (Mochi's RoPE) then runs as on CUDA (float32 there: disabled, warned).
    module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    return module


_DIRECT_KERNELS = (
    "empty.memory_format", "empty_strided", "_copy_from", "_copy_from_and_resize",
    # arange's generic kernel resizes its empty result (the CPU tensor, not the wrapper): made whole here instead.
    "arange", "arange.start", "arange.start_step",
    # `torch.tensor([t])` of a 0-d virtual tensor reads `t.item()` with Python dispatch off.
    "_local_scalar_dense",
)


def _backend_kernel(op, *args, **kwargs):
    return run_on_cpu(op, args, kwargs)
