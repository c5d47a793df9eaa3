"""The virtual accelerators as a torch device type: torch's PrivateUse1 backend, renamed `vgpu`.

Registered once per process, on first use (`ensure_backend()`), through torch's Python-backend setup (device
guard, hooks, device module). The backend's one kernel is a boxed fallback: an op that reaches it directly
(a factory such as `torch.randn(..., device="vgpu:1")`, the allocation inside `cpu_tensor.to("vgpu:1")`, or a
copy made while Python dispatch is off) runs on the CPU through `tensor.run_on_cpu`; every other op on a
virtual tensor goes through `VirtualTensor.__torch_dispatch__` first. `torch.Tensor.data` becomes
`tensor.DATA_PROPERTY` (torch's own descriptor, plus `cpu_tensor.data = virtual_tensor`, which torch's setter
cannot route to a Python backend and CUDA allows).

The device module (`torch.vgpu`) answers `is_available() -> False`, so `torch.accelerator` and the libraries
that ask it (diffusers' `get_device()`) keep seeing a CPU machine: only this library, through
`PLACEMENT_VIRTUAL_ACCELERATORS`, knows about virtual accelerators.
"""

from __future__ import annotations

import threading
import types

import torch

from ..errors import InvalidDeviceError
from .tensor import DATA_PROPERTY, compatible_shallow_copy_type, run_on_cpu

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
