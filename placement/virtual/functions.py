"""Python-level calls on a VirtualTensor answered before aten dispatch (`VirtualTensor.__torch_function__`).

- `target.data = value`: torch's setter copies the wrapper's metadata only, so the CPU tensor behind it is
  replaced here too (between the CPU and a virtual device the tensor types differ: the object is swapped);
- `.tolist()` (torch refuses it for subclasses; CUDA tensors answer it) and `.numpy()` (CUDA's refusal);
- attention (`F.scaled_dot_product_attention`) without autograd runs whole on the CPU tensors: its composite
  kernel picks the fused CPU kernel for CPU tensors and the math one for any other device type, so decomposing
  it on the virtual device would change the numbers;
- everything else runs as torch's default would, without torch's conversion of results to this class (which
  would turn the CPU result of `.cpu()` into a VirtualTensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .rules import common_device
from .tensor import VirtualTensor, is_virtual, unwrap_argument, wrap_result

_DATA = torch._C.TensorBase.__dict__["data"]  # the `tensor.data` descriptor
RUN_WHOLE_WITHOUT_AUTOGRAD = frozenset({F.scaled_dot_product_attention})


def handle_function(func, args: tuple, kwargs: dict):
    if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
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


def set_data(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.data = value` with a virtual tensor on either side, as it works on a GPU: the tensor object stays
    the same (a parameter keeps its identity and requires_grad), its contents and device become `value`'s."""
    if isinstance(target, VirtualTensor) and isinstance(value, VirtualTensor):
        with torch._C.DisableTorchFunctionSubclass():
            _DATA.__set__(target, value)  # sizes, strides, dtype and device of the wrapper
        target._inner = value._inner
        return
    if not isinstance(target, VirtualTensor) and not isinstance(value, VirtualTensor):
        with torch._C.DisableTorchFunctionSubclass():
            _DATA.__set__(target, value)
        return
    # Between the CPU and a virtual device the two tensor types differ: swap the new contents into the object.
    replacement = value.detach()
    if isinstance(target, nn.Parameter):
        replacement = nn.Parameter(replacement, requires_grad=target.requires_grad)
    else:
        replacement.requires_grad_(target.requires_grad)
    extra = {key: item for key, item in target.__dict__.items() if key not in ("_inner", "_is_param")}
    replacement.__dict__.update(extra)
    torch.utils.swap_tensors(target, replacement)
