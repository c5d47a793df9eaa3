"""A bitsandbytes layer built on meta has no quantization state until its weights are quantized on a device, so
its own forward cannot run in an estimate; the estimate counts what bitsandbytes allocates for a batch of tokens
instead: the weight dequantized to the compute dtype, then the matmul (placement/activations/fake_tensors.py, 4.)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from placement.activations.estimate import estimate_call

bnb = pytest.importorskip("bitsandbytes")


def test_a_meta_built_4bit_linear_is_estimated_as_its_dequantized_matmul():
    with torch.device("meta"):
        quantized = nn.Sequential(bnb.nn.Linear4bit(32, 64, compute_dtype=torch.bfloat16, quant_type="nf4"))
        plain = nn.Sequential(nn.Linear(32, 64, dtype=torch.bfloat16))
    tokens = torch.empty(1, 8, 32, dtype=torch.bfloat16, device="meta")
    estimate = estimate_call(quantized, (tokens,))
    assert estimate.output.shape == (1, 8, 64) and estimate.output.dtype is torch.bfloat16
    dequantized_weight = 64 * 32 * 2  # the temporary bitsandbytes makes in the compute dtype
    assert estimate.peak_bytes >= estimate_call(plain, (tokens,)).peak_bytes + dequantized_weight
    assert type(quantized[0]).forward is bnb.nn.Linear4bit.forward and "forward" not in vars(quantized[0])
