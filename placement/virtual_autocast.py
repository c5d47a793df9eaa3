"""`torch.autocast` on the strict virtual accelerators, as CUDA runs it.

torch runs autocast for a PrivateUse1 backend only through kernels the backend registers at `AutocastPrivateUse1`
(it ships CUDA's and the CPU's, none for us), and asks the backend's module which lower precisions it takes
(`torch.vgpu.get_amp_supported_dtype`, in virtual.py). Without them a model that opens
`torch.autocast(x.device.type, ...)` (Mochi's RoPE does) fails on `vgpu` where it runs on CUDA. The kernels here
apply CUDA's policies (aten/src/ATen/autocast_mode.cpp) to each op CUDA registers an autocast kernel for, casting
the floating, non-double tensors on the virtual device as CUDA's `cached_cast` casts CUDA tensors; every other op
falls through. Each op then runs below autocast, as on CUDA, so its composite parts are not cast again.
"""

from __future__ import annotations

import functools

import torch

KEY = "AutocastPrivateUse1"
_EXCLUDED = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# CUDA's lower_precision_fp ops: run in the autocast dtype (float16 or bfloat16).
LOWER_PRECISION = (
    "_convolution", "_convolution.deprecated", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell",
    "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d", "conv2d",
    "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "einsum", "gru_cell", "linalg_multi_dot", "linalg_vecdot",
    "linear", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_relu_cell", "rnn_tanh_cell",
    "scaled_dot_product_attention")
# CUDA's fp32 ops (fp32_append_dtype's norms included: the same result as a float32 input): run in float32.
FLOAT32 = (
    "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "acos", "asin", "binary_cross_entropy_with_logits", "cdist", "cosh",
    "cosine_embedding_loss", "cosine_similarity", "dist", "erfinv", "exp", "expm1", "frobenius_norm.dim",
    "group_norm", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "layer_norm", "log", "log10", "log1p",
    "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss", "multilabel_margin_loss",
    "native_layer_norm", "nll_loss", "nll_loss2d", "norm.Scalar", "norm.ScalarOpt_dim", "nuclear_norm",
    "nuclear_norm.dim", "pdist", "poisson_nll_loss", "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softplus", "tan",
    "triplet_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_trilinear3d")
# CUDA's fp32_set_opt_dtype ops: reduce in float32 unless the call names a dtype.
FLOAT32_UNLESS_DTYPE = ("cumprod", "cumsum", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
                        "linalg_vector_norm", "log_softmax.int", "prod", "prod.dim_int", "softmax.int", "sum",
                        "sum.dim_IntList")
# CUDA's promote ops: their tensors meet at the widest floating dtype among them.
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
           "tensordot", "vdot")
# CUDA refuses it under autocast (unsafe in float16), with this message.
BANNED = ("binary_cross_entropy",)


def _eligible(value, device_type: str) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == device_type and value.is_floating_point()
            and value.dtype is not torch.float64)


def _cast(value, dtype: torch.dtype, device_type: str):
    """`value` (an argument, or a list of them) with its eligible tensors in `dtype`."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype, device_type) for item in value)
    return value.to(dtype) if _eligible(value, device_type) and value.dtype != dtype else value


def _tensors(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value


def _below_autocast(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
        return op(*args, **kwargs)


def _device_type() -> str:
    return torch._C._get_privateuse1_backend_name()


def _to_dtype(dtype_of, op, *args, **kwargs):
    device_type = _device_type()
    dtype = dtype_of(device_type, args, kwargs)
    args = tuple(_cast(value, dtype, device_type) for value in args)
    kwargs = {key: _cast(value, dtype, device_type) for key, value in kwargs.items()}
    return _below_autocast(op, args, kwargs)


def _lower(device_type: str, args, kwargs) -> torch.dtype:
    return torch.get_autocast_dtype(device_type)


def _float32(device_type: str, args, kwargs) -> torch.dtype:
    return torch.float32


def _widest(device_type: str, args, kwargs) -> torch.dtype:
    widest = torch.get_autocast_dtype(device_type)
    for tensor in _tensors((*args, *kwargs.values())):
        if _eligible(tensor, device_type):
            widest = torch.promote_types(widest, tensor.dtype)
    return widest


def _float32_unless_dtype(op, *args, **kwargs):
    names = [argument.name for argument in op._schema.arguments]
    position = names.index("dtype")
    given = args[position] if len(args) > position else kwargs.get("dtype")
    if given is None and args and _eligible(args[0], _device_type()):
        args, kwargs = args[:position], {**kwargs, "dtype": torch.float32}
    return _below_autocast(op, args, kwargs)


def _banned(op, *args, **kwargs):
    raise RuntimeError(
        f"torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (as on CUDA); use "
        f"torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss ({op}).")


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def register_autocast_kernels() -> tuple:
    """The libraries holding the `AutocastPrivateUse1` kernels (keep them alive): CUDA's policies, and a
    fallthrough for every other op."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, KEY)
    kernels = torch.library.Library("aten", "IMPL", KEY)
    policies = [(LOWER_PRECISION, functools.partial(_to_dtype, _lower)),
                (FLOAT32, functools.partial(_to_dtype, _float32)),
                (PROMOTE, functools.partial(_to_dtype, _widest)),
                (FLOAT32_UNLESS_DTYPE, _float32_unless_dtype), (BANNED, _banned)]
    for names, policy in policies:
        for name in names:
            kernels.impl(name, functools.partial(policy, _op(name)))
    return fallthrough, kernels


POLICY_OPS = (*LOWER_PRECISION, *FLOAT32, *FLOAT32_UNLESS_DTYPE, *PROMOTE, *BANNED)

__all__ = ["POLICY_OPS", "register_autocast_kernels"]
