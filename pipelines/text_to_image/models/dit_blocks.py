"""The blocks of the MMDiT/Flux-like DiT: adaLN modulation, joint (double-stream) and single-stream blocks.

Layouts follow diffusers' `FluxTransformer2DModel` so the "flux" preset has its parameter count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Activation, FeedForward, MLPEmbedding, merge_heads, split_heads, timestep_embedding

TIMESTEP_CHANNELS = 256


class AdaLNZero(nn.Module):
    """LayerNorm (no affine) modulated by `chunks` vectors projected from the conditioning vector.

    Returns the modulated input and the remaining modulation vectors (gates and the MLP's shift/scale).
    """

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift, scale, *rest = self.linear(F.silu(cond)).chunk(self.chunks, dim=-1)
        return (modulate(self.norm(x), shift, scale), *rest)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class QKV(nn.Module):
    """Query/key/value projections of one stream, with per-head RMSNorm on queries and keys (Flux's qk-norm)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        head_dim = dim // heads
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.norm_q(split_heads(self.to_q(x), self.heads))
        k = self.norm_k(split_heads(self.to_k(x), self.heads))
        return q, k, split_heads(self.to_v(x), self.heads)


def joint_attention(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the concatenation of several streams' tokens (text first, then image)."""
    q, k, v = (torch.cat(tensors, dim=2) for tensors in zip(*parts))
    return merge_heads(F.scaled_dot_product_attention(q, k, v))


class DoubleStreamBlock(nn.Module):
    """Text and image keep their own weights but attend jointly (MMDiT / Flux double block)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = AdaLNZero(dim, 6)
        self.norm1_context = AdaLNZero(dim, 6)
        self.qkv = QKV(dim, heads)
        self.qkv_context = QKV(dim, heads)
        self.to_out = nn.Linear(dim, dim)
        self.to_add_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, hidden, Activation.GELU_TANH)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = FeedForward(dim, hidden, Activation.GELU_TANH)

    def forward(self, image: torch.Tensor, text: torch.Tensor, cond: torch.Tensor):
        image_in, image_gate, image_shift, image_scale, image_gate_mlp = self.norm1(image, cond)
        text_in, text_gate, text_shift, text_scale, text_gate_mlp = self.norm1_context(text, cond)
        attended = joint_attention([self.qkv_context(text_in), self.qkv(image_in)])
        text_attn, image_attn = attended.split([text.shape[1], image.shape[1]], dim=1)

        image = image + image_gate[:, None] * self.to_out(image_attn)
        image_mlp = self.ff(modulate(self.norm2(image), image_shift, image_scale))
        image = image + image_gate_mlp[:, None] * image_mlp

        text = text + text_gate[:, None] * self.to_add_out(text_attn)
        text_mlp = self.ff_context(modulate(self.norm2_context(text), text_shift, text_scale))
        text = text + text_gate_mlp[:, None] * text_mlp
        return image, text


class SingleStreamBlock(nn.Module):
    """One stream over [text; image] tokens: attention and MLP in parallel from one modulated input (Flux)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm = AdaLNZero(dim, 3)
        self.qkv = QKV(dim, heads)
        self.proj_mlp = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(dim + hidden, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        modulated, gate = self.norm(x, cond)
        attended = joint_attention([self.qkv(modulated)])
        mlp = F.gelu(self.proj_mlp(modulated), approximate="tanh")
        return x + gate[:, None] * self.proj_out(torch.cat([attended, mlp], dim=-1))


class TimeTextConditioning(nn.Module):
    """The conditioning vector of adaLN: timestep embedding plus the projected pooled text (one module, so a
    device map never separates the two halves of the sum)."""

    def __init__(self, dim: int, pooled_projection_dim: int | None):
        super().__init__()
        self.timestep_embedder = MLPEmbedding(TIMESTEP_CHANNELS, dim)
        self.text_embedder = MLPEmbedding(pooled_projection_dim, dim) if pooled_projection_dim else None

    def forward(self, timesteps: torch.Tensor, pooled: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        cond = self.timestep_embedder(timestep_embedding(timesteps, TIMESTEP_CHANNELS).to(dtype))
        if self.text_embedder is not None and pooled is not None:
            cond = cond + self.text_embedder(pooled.to(dtype))
        return cond


class OutputLayer(nn.Module):
    """Final adaLN (shift and scale from the conditioning vector) and projection back to patch pixels."""

    def __init__(self, dim: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(cond)).chunk(2, dim=-1)
        return self.proj_out(modulate(self.norm(x), shift, scale))


def sincos_position_embedding(height: int, width: int, dim: int, device, dtype) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding of a height x width grid of patches -> (height*width, dim).

    Half the channels encode the row, half the column. It carries no parameters (DiT / SD3 style); the
    position information is what matters here, not Flux's exact rotary scheme.
    """
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter)
    rows = torch.arange(height, dtype=torch.float32, device=device)[:, None] * omega
    cols = torch.arange(width, dtype=torch.float32, device=device)[:, None] * omega
    row_emb = torch.cat([rows.sin(), rows.cos()], dim=-1)[:, None, :].expand(height, width, -1)
    col_emb = torch.cat([cols.sin(), cols.cos()], dim=-1)[None, :, :].expand(height, width, -1)
    embedding = torch.cat([row_emb, col_emb], dim=-1).reshape(height * width, -1)
    return F.pad(embedding, (0, dim - embedding.shape[-1])).to(dtype)
