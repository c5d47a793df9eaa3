"""Count scaled-dot-product attention the way the fused GPU kernels run it.

On an accelerator, `torch.nn.functional.scaled_dot_product_attention` runs the flash or memory-efficient
kernel: it never materialises the L x S score matrix; it allocates the output (L x Ev per head) and, for
flash, a float32 log-sum-exp row (L per head). On meta or fake tensors there is no such kernel, and the
op falls back to the math path, which builds the full score matrix (and its softmax) — an estimate that is
~10x too high for image-size sequence lengths. `FusedAttentionAccounting` intercepts the Python call before
dispatch (so it holds whichever device, backend choice or dispatch-mode order is in effect) and replaces it
with exactly the allocations of the fused kernel.

What is left out, on purpose: the kernels' on-chip tiles (not device memory), and the math fallback a GPU
takes for unsupported shapes (e.g. head dims above 256 on older cards) — such models are rare and would be
under-estimated by the score matrix.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def fused_attention_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Allocate what a flash/memory-efficient attention kernel allocates and return its (empty) output.

    The signature is `scaled_dot_product_attention`'s, so it can stand in for it; the mask, dropout, causal
    flag and scale change values, not memory. The log-sum-exp is allocated alongside the output and freed
    when the call returns, so it shows in the peak exactly while the kernel runs.
    """
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "scaled_dot_product_attention needs query, key and value with the same number (>= 2) of dims; "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        )
    if enable_gqa:
        # Grouped-query attention: key/value carry fewer heads; the output has the query's heads.
        batch_shape = tuple(query.shape[:-2])
    else:
        batch_shape = tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    rows = batch_shape + (query.shape[-2],)
    log_sum_exp = query.new_empty(rows, dtype=torch.float32)
    output = query.new_empty(rows + (value.shape[-1],))
    del log_sum_exp
    return output


class FusedAttentionAccounting(TorchFunctionMode):
    """Within this mode, `F.scaled_dot_product_attention` allocates like the fused kernels (see module doc), and
    `on_call(query, key, value, output)`, when given, is told of each call (the FLOP tally counts it: no aten
    attention op reaches dispatch)."""

    def __init__(self, on_call: Callable[..., None] | None = None) -> None:
        super().__init__()
        self._on_call = on_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            output = fused_attention_output(*args, **kwargs)
            if self._on_call is not None:
                query, key, value = [args[i] if i < len(args) else kwargs[name]
                                     for i, name in enumerate(("query", "key", "value"))]
                self._on_call(query, key, value, output)
            return output
        return func(*args, **kwargs)
