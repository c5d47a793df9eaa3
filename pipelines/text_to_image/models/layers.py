"""Transformer pieces shared by the reference models: attention, feed-forward, norms, timestep embeddings.

Every attention goes through `torch.nn.functional.scaled_dot_product_attention`: the activation-memory
estimator of the planner observes that call, and it is the fast kernel on every backend.
"""

from __future__ import annotations

import math
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn


class Activation(str, Enum):
    """Feed-forward activations of the architectures we mirror (a str enum: it is stored in config.json)."""

    GELU = "gelu"
    GELU_TANH = "gelu_tanh"  # Flux / MMDiT
    QUICK_GELU = "quick_gelu"  # CLIP
    GEGLU = "geglu"  # Stable Diffusion transformer blocks: GELU-gated, one fused input projection
    GATED_GELU = "gated_gelu"  # T5 v1.1: separate gate and up projections

    @property
    def is_gated(self) -> bool:
        return self in (Activation.GEGLU, Activation.GATED_GELU)


class NormKind(str, Enum):
    LAYER_NORM = "layer_norm"
    RMS_NORM = "rms_norm"


def make_norm(kind: NormKind, dim: int, eps: float, *, affine: bool = True) -> nn.Module:
    if kind is NormKind.RMS_NORM:
        return nn.RMSNorm(dim, eps=eps, elementwise_affine=affine)
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)


def apply_activation(activation: Activation, x: torch.Tensor) -> torch.Tensor:
    if activation is Activation.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if activation is Activation.QUICK_GELU:
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)


class FeedForward(nn.Module):
    """dim -> inner_dim -> dim. Gated activations multiply GELU(gate) with a second projection."""

    def __init__(self, dim: int, inner_dim: int, activation: Activation, *, bias: bool = True):
        super().__init__()
        self.activation = Activation(activation)
        if self.activation is Activation.GEGLU:
            # One projection producing both halves, as diffusers' GEGLU (same parameter layout).
            self.proj_in = nn.Linear(dim, 2 * inner_dim, bias=bias)
        else:
            self.proj_in = nn.Linear(dim, inner_dim, bias=bias)
        if self.activation is Activation.GATED_GELU:
            self.proj_gate = nn.Linear(dim, inner_dim, bias=bias)
        self.proj_out = nn.Linear(inner_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is Activation.GEGLU:
            hidden, gate = self.proj_in(x).chunk(2, dim=-1)
            hidden = hidden * F.gelu(gate)
        elif self.activation is Activation.GATED_GELU:
            hidden = self.proj_in(x) * F.gelu(self.proj_gate(x), approximate="tanh")
        else:
            hidden = apply_activation(self.activation, self.proj_in(x))
        return self.proj_out(hidden)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, heads*D) -> (B, heads, S, D), the layout scaled_dot_product_attention takes."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, S, D) -> (B, S, heads*D)."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


class Attention(nn.Module):
    """Multi-head self- or cross-attention (cross when `context_dim` is given).

    `forward(x, context=None, mask=None)`: `mask` is a boolean (B, 1, S_q or 1, S_kv) tensor, True where
    attention is allowed, or None; `causal=True` adds a causal mask (text encoders of the CLIP kind).
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int,
        head_dim: int,
        context_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = True,
    ):
        super().__init__()
        inner = heads * head_dim
        kv_dim = context_dim if context_dim is not None else dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=qkv_bias)
        self.to_k = nn.Linear(kv_dim, inner, bias=qkv_bias)
        self.to_v = nn.Linear(kv_dim, inner, bias=qkv_bias)
        self.to_out = nn.Linear(inner, dim, bias=out_bias)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        causal: bool = False,
    ) -> torch.Tensor:
        source = x if context is None else context
        q = split_heads(self.to_q(x), self.heads)
        k = split_heads(self.to_k(source), self.heads)
        v = split_heads(self.to_v(source), self.heads)
        if causal and mask is not None:
            # SDPA refuses is_causal together with an explicit mask: fold the causal part into the mask.
            seq = x.shape[1]
            lower = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            mask, causal = mask & lower, False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.to_out(merge_heads(out))


def timestep_embedding(timesteps: torch.Tensor, dim: int, *, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding (cos first, as diffusers' `flip_sin_to_cos=True`) of (B,) timesteps -> (B, dim)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps.float()[:, None] * torch.exp(exponent)[None, :]
    embedding = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


class MLPEmbedding(nn.Module):
    """in_dim -> out_dim -> out_dim with SiLU between: diffusers' TimestepEmbedding / text projections."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))

