"""DiT: an MMDiT/Flux-like diffusion transformer in diffusers' `FluxTransformer2DModel` layout.

Same call as `UNet`'s; it patchifies the (B, C, H, W) latents itself. Flux-dev's guidance embedding is left
out: the reference pipeline uses classifier-free guidance."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import PositiveFloat, PositiveInt, model_validator
from torch import nn

from ...folder.class_registry import library_class
from ...framework.modeling import ModelConfig, ModelMixin
from .layers import (
    Activation,
    FeedForward,
    MLPEmbedding,
    check_denoiser_inputs,
    merge_heads,
    split_heads,
    timestep_embedding,
    timesteps_for_batch,
)


TIMESTEP_CHANNELS = 256


class AdaLNZero(nn.Module):
    """LayerNorm (no affine) modulated by the conditioning; returns the input modulated and the other vectors."""

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
    """Timestep embedding plus projected pooled text: one module, so a device map never splits the sum."""

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
    """Fixed 2-D sin-cos embedding of a height x width patch grid (DiT / SD3 style, not Flux's rotary one)."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter)
    rows = torch.arange(height, dtype=torch.float32, device=device)[:, None] * omega
    cols = torch.arange(width, dtype=torch.float32, device=device)[:, None] * omega
    row_emb = torch.cat([rows.sin(), rows.cos()], dim=-1)[:, None, :].expand(height, width, -1)
    col_emb = torch.cat([cols.sin(), cols.cos()], dim=-1)[None, :, :].expand(height, width, -1)
    embedding = torch.cat([row_emb, col_emb], dim=-1).reshape(height * width, -1)
    return F.pad(embedding, (0, dim - embedding.shape[-1])).to(dtype)


class DiTConfig(ModelConfig):
    in_channels: PositiveInt = 16
    patch_size: PositiveInt = 2
    hidden_size: PositiveInt = 3072
    num_heads: PositiveInt = 24
    num_double_layers: int = 19
    num_single_layers: int = 38
    mlp_ratio: PositiveFloat = 4.0
    joint_attention_dim: PositiveInt = 4096
    pooled_projection_dim: PositiveInt | None = 768

    @model_validator(mode="after")
    def _consistent(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_double_layers < 0 or self.num_single_layers < 0:
            raise ValueError("num_double_layers and num_single_layers must be >= 0")
        return self


@library_class
class DiT(ModelMixin):
    config_class = DiTConfig
    _no_split_modules = ["DoubleStreamBlock", "SingleStreamBlock", "TimeTextConditioning", "OutputLayer"]
    presets: ClassVar[dict[str, DiTConfig]] = {
        "tiny": DiTConfig(
            in_channels=4, hidden_size=32, num_heads=2, num_double_layers=1, num_single_layers=2,
            joint_attention_dim=32, pooled_projection_dim=32,
        ),
        # FLUX.1: ~12B.
        "flux": DiTConfig(),
    }

    def __init__(self, config: DiTConfig):
        super().__init__(config)
        dim, patch_features = config.hidden_size, config.in_channels * config.patch_size**2
        self.conditioning = TimeTextConditioning(dim, config.pooled_projection_dim)
        self.x_embedder = nn.Linear(patch_features, dim)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(dim, config.num_heads, config.mlp_ratio) for _ in range(config.num_double_layers)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(dim, config.num_heads, config.mlp_ratio) for _ in range(config.num_single_layers)
        )
        self.output = OutputLayer(dim, patch_features)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor | float | int,
                encoder_hidden_states: torch.Tensor, pooled: torch.Tensor | None = None) -> torch.Tensor:
        check_denoiser_inputs(type(self).__name__, self.config, latents, encoder_hidden_states, pooled,
                              spatial_multiple=self.config.patch_size, text_dim_field="joint_attention_dim")
        batch, _, height, width = latents.shape
        timesteps = timesteps_for_batch(type(self).__name__, timestep, batch, latents.device)
        cond = self.conditioning(timesteps, pooled, latents.dtype)

        image = self.x_embedder(self.patchify(latents))
        grid_h, grid_w = height // self.config.patch_size, width // self.config.patch_size
        image = image + sincos_position_embedding(grid_h, grid_w, image.shape[-1], image.device, image.dtype)
        text = self.context_embedder(encoder_hidden_states)
        for block in self.double_blocks:
            image, text = block(image, text, cond)
        # Without double blocks, text and image come from two embedders a device map may have put apart.
        joint = torch.cat([text.to(image.device), image], dim=1)
        for block in self.single_blocks:
            joint = block(joint, cond)
        image = joint[:, text.shape[1]:]
        return self.unpatchify(self.output(image, cond), height, width)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, C*p*p), patches in row-major order."""
        p = self.config.patch_size
        batch, channels, height, width = latents.shape
        x = latents.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, (height // p) * (width // p), channels * p * p)

    def unpatchify(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        p, channels = self.config.patch_size, self.config.in_channels
        batch = tokens.shape[0]
        x = tokens.reshape(batch, height // p, width // p, channels, p, p)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)
