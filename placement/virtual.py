"""Strict virtual accelerators: the test mode `PLACEMENT_VIRTUAL_ACCELERATORS=N` as N devices torch tells apart.

Each tensor belongs to the virtual device it was moved to (`tensor.device == torch.device("vgpu", k)`); an
operation that mixes two devices (two virtual accelerators, or one and a non-scalar CPU tensor) raises the error
CUDA raises, so a CPU test fails where a multi-GPU run would. The bytes stay in RAM and every op runs on the CPU:
results are a CPU run's on the same tensors. `placement.devices.torch_device` is the one place that hands these
devices out.

Device rules (`common_device`, `check_generator`): which device an operation on virtual-accelerator tensors
runs on, and the error when its inputs disagree. The rules are CUDA's, so that a CPU test fails where a GPU run would:
- every tensor argument must be on one device; a 0-dim CPU tensor is the one exception (a "CPU scalar", which
  CUDA's elementwise kernels accept next to device tensors);
- indexing ops also take CPU index tensors (`x[cpu_indices]`, `index_put_`), as CUDA does;
- `copy_` and `_to_copy` cross devices by design (they are how tensors move);
- a random op on a device needs a generator of that device type (a CPU generator is an error, as on CUDA).
The message is torch's own ("Expected all tensors to be on the same device, but found at least two devices,
cuda:0 and cuda:1!"), with the virtual devices' names and the operation appended.

`VirtualTensor`: a tensor of a virtual accelerator. Its bytes are an ordinary CPU tensor (`_inner`); its
`.device` is the virtual device (`vgpu:k`) it was moved to, in Python and in C++ alike.

It is a wrapper subclass (`__torch_dispatch__`, as torch's FakeTensor is): every aten op on it unwraps the CPU
tensors, checks that the arguments share one device (`common_device`, CUDA's rule and message), runs on the
CPU and wraps the results onto that device (`run_on_cpu`). The numbers are therefore those of a CPU run
on the same tensors (same kernels, sizes, strides and requires_grad flags); only the device bookkeeping is added.
What no backend can copy is where a CPU run's bytes were: CPU BLAS may round by the operands' address alignment
(tests/same_output.py has the measurement). A few Python-level calls are answered before dispatch
(`handle_function`: `.data =`, `.tolist()`, `.numpy()`, attention). Factories (`torch.randn(..., device="vgpu:1")`)
and copies from the CPU reach the backend's kernel (`ensure_backend`), which runs the same `run_on_cpu`.

aten ops (`run_on_cpu`): ops that move bytes (`copy_`, `_copy_from`) cross devices by design; pinning is refused
as CUDA refuses it for device tensors; composite ops that reach Python dispatch whole (under `inference_mode`)
are decomposed as autograd mode would have, except those whose decomposition picks a kernel by device type.

Python-level calls (`handle_function`), answered before aten dispatch:
- `target.data = value`: torch's setter copies the wrapper's metadata only, so the CPU tensor behind it is
  replaced too (between the CPU and a virtual device the tensor types differ: the object is swapped). A CPU
  target given a virtual value (`cpu_param.data = x.to("vgpu:0")`, diffusers' group offloading) is not asked
  here: torch asks the target only, so `torch.Tensor.data` becomes `DATA_PROPERTY`, which swaps it the same way;
- `.tolist()` (torch refuses it for subclasses; CUDA tensors answer it) and `.numpy()` (CUDA's refusal);
- attention (`F.scaled_dot_product_attention`) without autograd runs whole on the CPU tensors: its composite
  kernel picks the fused CPU kernel for CPU tensors and the math one for any other device type, so decomposing
  it on the virtual device would change the numbers;
- everything else runs as torch's default would, without torch's conversion of results to this class (which
  would turn the CPU result of `.cpu()` into a VirtualTensor).

The device type (`ensure_backend`): the virtual accelerators as torch's PrivateUse1 backend, renamed `vgpu`.

Registered once per process, on first use (`ensure_backend()`), through torch's Python-backend setup (device
guard, hooks, device module). The backend's one kernel is a boxed fallback: an op that reaches it directly
(a factory such as `torch.randn(..., device="vgpu:1")`, the allocation inside `cpu_tensor.to("vgpu:1")`, or a
copy made while Python dispatch is off) runs on the CPU through `run_on_cpu`; every other op on a
virtual tensor goes through `VirtualTensor.__torch_dispatch__` first. `torch.Tensor.data` becomes
`DATA_PROPERTY` (torch's own descriptor, plus `cpu_tensor.data = virtual_tensor`, which torch's setter
cannot route to a Python backend and CUDA allows).

The device module (`torch.vgpu`) answers `is_available() -> False`, so `torch.accelerator` and the libraries
that ask it (diffusers' `get_device()`) keep seeing a CPU machine: only this library, through
`PLACEMENT_VIRTUAL_ACCELERATORS`, knows about virtual accelerators.
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import return_and_correct_aliasing

from .errors import InvalidDeviceError

aten = torch.ops.aten

# Ops whose index arguments may stay on the CPU next to a device tensor (CUDA moves them itself).
CPU_INDICES_ALLOWED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                                 aten._unsafe_index, aten._unsafe_index_put})


def common_device(func, tensors: Sequence[torch.Tensor], *, cpu_indices: Sequence[torch.Tensor] = ()) -> torch.device:
    """The one device of `tensors` (in argument order; CPU scalars aside), else a RuntimeError (as torch raises on CUDA) naming the
    first two devices found. `cpu_indices` are index tensors that may stay on the CPU (CPU_INDICES_ALLOWED)."""
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
    """A random op on `device` draws from a generator of that device type (CUDA: "Expected a 'cuda' device type
    for generator but found 'cpu'"); draw on the CPU and move the result instead, as diffusers' randn_tensor does."""
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
        # Only reached as `type(param)(value, requires_grad=...)`: accelerate's set_module_tensor_to_device
        # rebuilds a parameter through its class, which for a parameter of a virtual device is this one.
        # nn.Parameter keeps the value's device (a VirtualTensor flagged as a parameter, or a plain CPU one).
        return nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_on_cpu(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if any(not issubclass(kind, VirtualTensor) for kind in types):
            # Another tensor subclass takes part (torchao's Int8Tensor weight, its inner tensors virtual after
            # `.to(vgpu)`): its own handler runs first, as on CUDA, where it is the only one (F.linear is its
            # quantized kernel there, not aten ops it does not implement).
            return NotImplemented
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


def wrap(inner: torch.Tensor, device: torch.device, *, requires_grad: bool = False) -> VirtualTensor:
    """`inner` (a CPU tensor) as a tensor of virtual device `device`; they share bytes."""
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
    """`value` with VirtualTensors replaced by their CPU tensors; every tensor met is appended to `tensors`.
    aten arguments nest one level at most (Tensor[], Tensor?[]), so no general tree walk is needed."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return value._inner if isinstance(value, VirtualTensor) else value
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(unwrap_argument(item, tensors) for item in value)
    return value


def wrap_result(out, device: torch.device, *, requires_grad: bool = False):
    """Every tensor in an op's result (a tensor, or a list/tuple of them) put on `device`."""
    if isinstance(out, torch.Tensor):
        return wrap(out, device, requires_grad=requires_grad)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_result(item, device, requires_grad=requires_grad) for item in out)
    return out


# ------------------------------------------------------------------------------------------- aten ops
# Composite ops run whole on the CPU tensors, never decomposed: their decomposition depends on the device type.
RUN_WHOLE = frozenset({aten.scaled_dot_product_attention})


def run_on_cpu(func, args: tuple, kwargs: dict):
    """Run aten op `func` on the CPU tensors behind `args`, and put its results on the arguments' device."""
    packet = func.overloadpacket
    special = _SPECIAL.get(packet)
    if special is not None:
        return special(func, args, kwargs)
    if packet not in RUN_WHOLE and _is_composite(func):
        # Under inference_mode composite ops (`to.device`, `linear`) reach Python dispatch whole; decompose them
        # as autograd mode would have, so the device logic sees only the ops they are made of. Through their C++
        # kernel, which is what autograd mode and a plain CPU tensor run: `func.decompose` prefers the Python
        # decompositions torch._decomp registers on import (matmul's never folds a batch into one mm, so its
        # sums run in another order), which would make the numbers depend on what was imported before.
        return func._op_dk(_COMPOSITE_KEY, *args, **kwargs)
    tensors: list[torch.Tensor] = []
    inner_args = tuple(unwrap_argument(value, tensors) for value in args)
    inner_kwargs = {key: unwrap_argument(value, tensors) for key, value in kwargs.items()}
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
    """An `out=` virtual tensor the op resized: CUDA resizes it, but a wrapper's sizes are fixed when it is made,
    so it would keep its old shape over the new bytes. Refused instead of left wrong (factories that resize their
    own result, such as arange, are made whole by the backend's kernels)."""
    for tensor in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(tensor, VirtualTensor) and tensor.shape != tensor._inner.shape:
            raise RuntimeError(
                f"{func}: an out= tensor of shape {list(tensor.shape)} on {tensor.device} cannot be resized on "
                f"virtual accelerators to the result of shape {list(tensor._inner.shape)}: give out= the result's "
                "shape, or run with PLACEMENT_VIRTUAL_STRICT=0"
            )


def _view_requires_grad(func, args: tuple) -> bool:
    """A view of a tensor that requires grad requires grad too, in every grad mode, as autograd's view tracking
    makes it on the CPU. Under inference_mode no autograd layer runs above this backend to say so, and composite
    kernels read the flag: matmul folds a batch into one mm when its weight (a view, `weight.t()`) requires grad,
    and sums in another order when it does not."""
    return (torch.is_inference_mode_enabled() and func.is_view and isinstance(args[0], torch.Tensor)
            and args[0].requires_grad)


_COMPOSITE_KEY = torch._C.DispatchKey.CompositeImplicitAutograd


def _is_composite(func) -> bool:
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE_KEY)
    return known


_COMPOSITE: dict = {}


def _copy(func, args, kwargs):
    """copy_ crosses devices by design: it is how bytes move (the destination keeps its device)."""
    destination, source = args[0], args[1]
    unwrap(destination).copy_(unwrap(source), *args[2:], **kwargs)
    return destination


def _copy_from(func, args, kwargs):
    """_copy_from(src, dst): what copy_ becomes when it reaches the backend's kernel directly."""
    source, destination = args[0], args[1]
    unwrap(destination).copy_(unwrap(source))
    return destination


def _pin_memory(func, args, kwargs):
    raise RuntimeError(f"cannot pin a {args[0].device} tensor: only dense CPU tensors can be pinned")


def compatible_shallow_copy_type(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether `tensor.data = other` may keep the object, as torch answers for CUDA: yes for two dense tensors of
    CUDA and the CPU (a PrivateUse1 tensor would be told no). `Module.to()` asks it for every parameter, and
    assigns `param.data` where yes, keeping each parameter the same object, so tied weights (T5's `shared` and
    `encoder.embed_tokens`) stay one tensor across a move between the CPU and a virtual GPU, as on CUDA."""
    return tensor.layout == other.layout == torch.strided


_SPECIAL = {
    aten.copy_: _copy,
    aten._copy_from: _copy_from,
    aten._copy_from_and_resize: _copy_from,
    aten.is_pinned: lambda func, args, kwargs: False,
    aten._pin_memory: _pin_memory,
    # Composite, so autograd mode answers it at the AutogradPrivateUse1 key (backend.py); inference_mode here.
    aten._has_compatible_shallow_copy_type: lambda func, args, kwargs: compatible_shallow_copy_type(*args),
}


# ------------------------------------------------------------------------------- Python-level calls
_DATA = torch._C.TensorBase.__dict__["data"]  # the `tensor.data` descriptor
RUN_WHOLE_WITHOUT_AUTOGRAD = frozenset({F.scaled_dot_product_attention})


def handle_function(func, args: tuple, kwargs: dict):
    if getattr(func, "__self__", None) in (_DATA, DATA_PROPERTY) and func.__name__ == "__set__":
        return set_data(*args)
    if func is torch.Tensor.tolist:
        return args[0]._inner.tolist()
    if func is torch.Tensor.numpy:
        raise TypeError(f"can't convert {args[0].device} device type tensor to numpy. Use Tensor.cpu() to copy "
                        "the tensor to host memory first.")
    if func in RUN_WHOLE_WITHOUT_AUTOGRAD:
        tensors: list[torch.Tensor] = []
        inner_args = tuple(unwrap_argument(value, tensors) for value in args)
        inner_kwargs = {key: unwrap_argument(value, tensors) for key, value in kwargs.items()}
        if not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)):
            device = common_device(func, tensors)
            out = func(*inner_args, **inner_kwargs)
            return wrap_result(out, device) if is_virtual(device) else out
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def set_data(target: VirtualTensor, value: torch.Tensor) -> None:
    """`target.data = value` on a virtual tensor, as it works on a GPU: the tensor object stays the same (a
    parameter keeps its identity and requires_grad), its contents and device become `value`'s. (A CPU target
    given a virtual value never reaches `__torch_function__`: `DATA_PROPERTY` answers it.)"""
    if isinstance(value, VirtualTensor):
        with torch._C.DisableTorchFunctionSubclass():
            _DATA.__set__(target, value)  # sizes, strides, dtype and device of the wrapper
        target._inner = value._inner
        return
    swap_into(target, value)  # to the CPU the two tensor types differ


def swap_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Make the object `target` hold `value`'s contents on `value`'s device, where `target` and `value` are of
    different tensor types (a CPU tensor and a virtual one): the object is kept (ids, dicts keyed by it, the
    module slots holding it), with its requires_grad, its parameter-ness and its other attributes."""
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


# --------------------------------------------------------------------------------- `tensor.data` itself
def _get_data(tensor: torch.Tensor) -> torch.Tensor:
    return _DATA.__get__(tensor, type(tensor))


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    # torch's setter asks only the target for __torch_function__: a CPU tensor given a virtual value would go
    # straight to C++ set_data, which refuses two tensor types ("incompatible tensor type"). On CUDA the two
    # are one type and the assignment moves the tensor: diffusers' group offloading onloads that way.
    if isinstance(value, VirtualTensor) and not isinstance(tensor, VirtualTensor):
        swap_into(tensor, value)
    else:
        _DATA.__set__(tensor, value)  # torch's own, __torch_function__ of the target's class included


# `torch.Tensor.data` while strict virtual accelerators are on (`backend.ensure_backend` installs it): torch's
# descriptor for everything, plus the one assignment it cannot route.
DATA_PROPERTY = property(_get_data, _set_data, doc=_DATA.__doc__)


BACKEND_NAME = "vgpu"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "library": the torch.library.Library objects holding the kernels (kept alive)


def ensure_backend() -> None:
    """Register the `vgpu` device type with torch, once; an error that says why when torch's PrivateUse1
    backend already belongs to another device type (e.g. Ascend's "npu")."""
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
        for name, op in _DIRECT_KERNELS.items():
            kernels.impl(name, _direct_kernel(op))
        # Answered before its composite kernel runs (which tells a PrivateUse1 tensor "no", CUDA's "yes").
        autograd = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
        autograd.impl("_has_compatible_shallow_copy_type", compatible_shallow_copy_type)
        torch.Tensor.data = DATA_PROPERTY  # `cpu_tensor.data = virtual_tensor`, as CUDA allows (tensor.py)
        _STATE["library"] = (fallback, kernels, autograd)


def _register_device_type() -> None:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=BACKEND_NAME, backend_module=_device_module())


def _device_module() -> types.ModuleType:
    """`torch.vgpu`: what torch's generic device code calls (seeding, synchronize, empty_cache): no-ops."""
    module = types.ModuleType(f"torch.{BACKEND_NAME}")
    module.is_available = lambda: False  # hidden from torch.accelerator (see the module docstring)
    module.is_initialized = lambda: True
    module.device_count = lambda: 0
    module.current_device = lambda: 0
    module._is_in_bad_fork = lambda: False
    module.manual_seed = lambda seed: None
    module.manual_seed_all = lambda seed: None
    module.synchronize = lambda device=None: None
    module.empty_cache = lambda: None
    return module


_DIRECT_KERNELS = {
    "empty.memory_format": torch.ops.aten.empty.memory_format,
    "empty_strided": torch.ops.aten.empty_strided.default,
    "_copy_from": torch.ops.aten._copy_from.default,
    "_copy_from_and_resize": torch.ops.aten._copy_from_and_resize.default,
    # arange's generic kernel allocates an empty result and lets arange.out resize it: that would resize the CPU
    # tensor behind the wrapper, not the wrapper (a wrapper's sizes are fixed when it is made). Made whole on the
    # CPU and wrapped instead, it has its length.
    "arange": torch.ops.aten.arange.default,
    "arange.start": torch.ops.aten.arange.start,
    "arange.start_step": torch.ops.aten.arange.start_step,
    # `torch.tensor([t])` of a 0-d virtual tensor reads `t.item()` with Python dispatch off.
    "_local_scalar_dense": torch.ops.aten._local_scalar_dense.default,
}


def _direct_kernel(op):
    def kernel(*args, **kwargs):
        return _backend_kernel(op, *args, **kwargs)

    return kernel


def _backend_kernel(op, *args, **kwargs):
    return run_on_cpu(op, args, kwargs)
