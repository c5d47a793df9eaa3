"""Layers and input checks shared by the reference models, in diffusers' parameter layouts (so presets have the
real models' parameter counts). Attention goes through `scaled_dot_product_attention`: the planner's
activation estimator observes that call."""

from __future__ import annotations

import math
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CallError


class Activation(str, Enum):
    """Feed-forward activations of the architectures we mirror (a str enum: it is stored in config.json)."""

    GELU = "gelu"
    GELU_TANH = "gelu_tanh"  # Flux / MMDiT
    QUICK_GELU = "quick_gelu"  # CLIP
    GEGLU = "geglu"  # Stable Diffusion transformer blocks: GELU-gated, one fused input projection
    GATED_GELU = "gated_gelu"  # T5 v1.1: separate gate and up projections


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
    """(B, S, heads*D) -> (B, heads, S, D)."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, S, D) -> (B, S, heads*D)."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


class Attention(nn.Module):
    """Multi-head self- or cross-attention; `mask` is boolean, True where attention is allowed."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, context_dim: int | None = None,
                 qkv_bias: bool = False, out_bias: bool = True):
        super().__init__()
        inner = heads * head_dim
        kv_dim = context_dim if context_dim is not None else dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=qkv_bias)
        self.to_k = nn.Linear(kv_dim, inner, bias=qkv_bias)
        self.to_v = nn.Linear(kv_dim, inner, bias=qkv_bias)
        self.to_out = nn.Linear(inner, dim, bias=out_bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None, *,
                causal: bool = False) -> torch.Tensor:
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


class ResnetBlock2D(nn.Module):
    """GroupNorm-SiLU-conv twice, with an optional timestep-embedding shift and a 1x1 shortcut when widths differ."""

    def __init__(self, in_channels: int, out_channels: int, *, temb_channels: int | None, groups: int,
                 eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=eps)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels) if temb_channels is not None else None
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=eps)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.conv1(F.silu(self.norm1(x)))
        if self.time_emb_proj is not None and temb is not None:
            hidden = hidden + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        hidden = self.conv2(F.silu(self.norm2(hidden)))
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return shortcut + hidden


class Downsample2D(nn.Module):
    """Halve height and width with a strided 3x3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample2D(nn.Module):
    """Double height and width (nearest) then a 3x3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class SpatialSelfAttention(nn.Module):
    """Single-head self-attention over all pixels of a feature map, with a residual (the VAE mid block's)."""

    def __init__(self, channels: int, *, groups: int, eps: float = 1e-6):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=eps)
        self.attention = Attention(channels, heads=1, head_dim=channels, qkv_bias=True, out_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)
        attended = self.attention(tokens).transpose(1, 2).reshape(batch, channels, height, width)
        return x + attended


def check_rank(model: str, name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.ndim != rank:
        raise CallError(
            f"{model}: `{name}` must be a {rank}-d tensor {layout}, got shape {tuple(tensor.shape)}."
        )


def check_last_dim(model: str, name: str, tensor: torch.Tensor, expected: int, config_field: str) -> None:
    if tensor.shape[-1] != expected:
        raise CallError(
            f"{model}: `{name}` has last dimension {tensor.shape[-1]} but config.{config_field} is {expected} "
            f"(shape {tuple(tensor.shape)}); pass embeddings from an encoder of that width."
        )


def check_channels(model: str, name: str, tensor: torch.Tensor, expected: int, config_field: str) -> None:
    if tensor.shape[1] != expected:
        raise CallError(
            f"{model}: `{name}` has {tensor.shape[1]} channels but config.{config_field} is {expected} "
            f"(shape {tuple(tensor.shape)})."
        )


def check_spatial_multiple(model: str, name: str, tensor: torch.Tensor, multiple: int) -> None:
    height, width = tensor.shape[-2:]
    if height % multiple or width % multiple:
        raise CallError(
            f"{model}: `{name}` is {height}x{width}; both sides must be multiples of {multiple}. "
            f"Choose an image size whose latents divide evenly."
        )


def check_pooled(model: str, pooled: torch.Tensor | None, expected_dim: int | None, batch: int) -> None:
    if expected_dim is None:
        if pooled is not None:
            raise CallError(
                f"{model}: got `pooled` but config.pooled_projection_dim is None (this model takes no pooled "
                f"text embedding); drop the argument or use a config with pooled_projection_dim set."
            )
        return
    if pooled is None:
        raise CallError(
            f"{model}: config.pooled_projection_dim is {expected_dim}, so `pooled` (B, {expected_dim}) is required."
        )
    check_rank(model, "pooled", pooled, 2, f"(B, {expected_dim})")
    check_last_dim(model, "pooled", pooled, expected_dim, "pooled_projection_dim")
    check_batch(model, "pooled", pooled, batch)


def check_denoiser_inputs(model: str, config, latents, encoder_hidden_states, pooled, *, spatial_multiple: int,
                          text_dim_field: str) -> None:
    check_rank(model, "latents", latents, 4, "(B, C, H, W)")
    check_channels(model, "latents", latents, config.in_channels, "in_channels")
    check_spatial_multiple(model, "latents", latents, spatial_multiple)
    check_rank(model, "encoder_hidden_states", encoder_hidden_states, 3, "(B, S, D)")
    text_dim = getattr(config, text_dim_field)
    check_last_dim(model, "encoder_hidden_states", encoder_hidden_states, text_dim, text_dim_field)
    check_batch(model, "encoder_hidden_states", encoder_hidden_states, latents.shape[0])
    check_pooled(model, pooled, config.pooled_projection_dim, latents.shape[0])


def check_batch(model: str, name: str, tensor: torch.Tensor, batch: int) -> None:
    if tensor.shape[0] != batch:
        raise CallError(
            f"{model}: `{name}` has batch size {tensor.shape[0]} but the latents have {batch}."
        )


def timesteps_for_batch(model: str, timestep: torch.Tensor | float | int, batch: int,
                        device: torch.device) -> torch.Tensor:
    """A number, a 0-d or a (B,) tensor as a float32 (B,) tensor on `device`."""
    t = torch.as_tensor(timestep, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.ndim != 1 or t.shape[0] not in (1, batch):
        raise CallError(
            f"{model}: `timestep` must be a number or a tensor of shape () or ({batch},), got {tuple(t.shape)}."
        )
    return t.to(dtype=torch.float32).expand(batch)
