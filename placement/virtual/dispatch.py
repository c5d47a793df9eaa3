"""Every aten op on a VirtualTensor: run on the CPU tensors behind it, results put on the arguments' device.

Ops that move bytes (`copy_`, `_copy_from`) cross devices by design; pinning is refused as CUDA refuses it for
device tensors; composite ops that reach Python dispatch whole (under `inference_mode`) are decomposed as
autograd mode would have, except those whose decomposition picks a kernel by device type (attention: the
virtual device would get the unfused math kernel, the CPU the fused one, and the numbers would differ).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from .rules import CPU_INDICES_ALLOWED, check_generator, common_device
from .tensor import is_virtual, unwrap, unwrap_argument, wrap_result

aten = torch.ops.aten
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
        # as autograd mode would have, so the device logic sees only the ops they are made of.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
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
    if is_virtual(target):
        out = wrap_result(out, target)
    return return_and_correct_aliasing(func, args, kwargs, out)


def _is_composite(func) -> bool:
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
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


_SPECIAL = {
    aten.copy_: _copy,
    aten._copy_from: _copy_from,
    aten._copy_from_and_resize: _copy_from,
    aten.is_pinned: lambda func, args, kwargs: False,
    aten._pin_memory: _pin_memory,
}
