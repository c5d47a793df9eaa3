"""The blocks of the conditional UNet: cross-attention transformers, down, mid and up blocks, conditioning.

Layouts follow diffusers' `UNet2DConditionModel` (SDXL flavour) so the "sdxl" preset has its parameter count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .conv_blocks import Downsample2D, ResnetBlock2D, Upsample2D
from .layers import Activation, Attention, FeedForward, MLPEmbedding, timestep_embedding


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention to the text, GEGLU feed-forward; each pre-LayerNorm with a residual."""

    def __init__(self, dim: int, *, head_dim: int, cross_attention_dim: int):
        super().__init__()
        heads = dim // head_dim
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads=heads, head_dim=head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads=heads, head_dim=head_dim, context_dim=cross_attention_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, 4 * dim, Activation.GEGLU)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2D(nn.Module):
    """GroupNorm, project the feature map to tokens, N transformer blocks, project back, residual."""

    def __init__(self, channels: int, *, depth: int, head_dim: int, cross_attention_dim: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.proj_in = nn.Linear(channels, channels)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(channels, head_dim=head_dim, cross_attention_dim=cross_attention_dim)
            for _ in range(depth)
        )
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        tokens = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        for block in self.transformer_blocks:
            tokens = block(tokens, context)
        tokens = self.proj_out(tokens)
        return x + tokens.transpose(1, 2).reshape(batch, channels, height, width)


def _maybe_transformer(channels: int, depth: int, head_dim: int, cross_dim: int, groups: int) -> nn.Module | None:
    if depth == 0:
        return None
    return Transformer2D(channels, depth=depth, head_dim=head_dim, cross_attention_dim=cross_dim, groups=groups)


class DownBlock(nn.Module):
    """Resnets (each followed by a transformer when `depth > 0`), then an optional downsample.

    `forward` returns the block's output and the states the matching up block concatenates (one per resnet,
    plus the downsampled one).
    """

    def __init__(self, in_channels: int, out_channels: int, *, num_layers: int, depth: int, head_dim: int,
                 cross_attention_dim: int, temb_channels: int, groups: int, add_downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb_channels=temb_channels,
                          groups=groups)
            for i in range(num_layers)
        )
        attentions = [_maybe_transformer(out_channels, depth, head_dim, cross_attention_dim, groups)
                      for _ in range(num_layers)]
        self.attentions = nn.ModuleList(attentions) if depth else None
        self.downsampler = Downsample2D(out_channels) if add_downsample else None

    @property
    def num_skips(self) -> int:
        return len(self.resnets) + (self.downsampler is not None)

    def forward(self, x, temb, context) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        skips = []
        for index, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[index](x, context)
            skips.append(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
            skips.append(x)
        return x, tuple(skips)


class MidBlock(nn.Module):
    """Resnet, then (transformer, resnet) pairs; SDXL has one pair with a 10-layer transformer."""

    def __init__(self, channels: int, *, depth: int, head_dim: int, cross_attention_dim: int,
                 temb_channels: int, groups: int):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(channels, channels, temb_channels=temb_channels, groups=groups) for _ in range(2)
        )
        self.attention = _maybe_transformer(channels, depth, head_dim, cross_attention_dim, groups)

    def forward(self, x, temb, context) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        if self.attention is not None:
            x = self.attention(x, context)
        return self.resnets[1](x, temb)


class UpBlock(nn.Module):
    """Resnets fed with the concatenation of the running state and a skip state, then an optional upsample.

    It takes all its skip states as one argument and concatenates inside itself, which is why it is in the
    UNet's `_no_split_modules`: cut across devices, the concatenation would see tensors on two devices.
    """

    def __init__(self, in_channels: int, skip_channels: list[int], out_channels: int, *, depth: int,
                 head_dim: int, cross_attention_dim: int, temb_channels: int, groups: int, add_upsample: bool):
        super().__init__()
        widths = [in_channels] + [out_channels] * (len(skip_channels) - 1)
        self.resnets = nn.ModuleList(
            ResnetBlock2D(width + skip, out_channels, temb_channels=temb_channels, groups=groups)
            for width, skip in zip(widths, skip_channels)
        )
        attentions = [_maybe_transformer(out_channels, depth, head_dim, cross_attention_dim, groups)
                      for _ in skip_channels]
        self.attentions = nn.ModuleList(attentions) if depth else None
        self.upsampler = Upsample2D(out_channels) if add_upsample else None

    def forward(self, x, skips: tuple[torch.Tensor, ...], temb, context) -> torch.Tensor:
        # Skips arrive in the order the down path produced them; the deepest is used first.
        for index, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips[-1 - index]], dim=1), temb)
            if self.attentions is not None:
                x = self.attentions[index](x, context)
        if self.upsampler is not None:
            x = self.upsampler(x)
        return x


class TimestepConditioning(nn.Module):
    """Timestep embedding plus (SDXL-like) the projected pooled text embedding, summed.

    One module, so that the sum is never split across devices by a device map.
    """

    def __init__(self, base_channels: int, temb_channels: int, pooled_projection_dim: int | None):
        super().__init__()
        self.base_channels = base_channels
        self.time_embedding = MLPEmbedding(base_channels, temb_channels)
        self.add_embedding = MLPEmbedding(pooled_projection_dim, temb_channels) if pooled_projection_dim else None

    def forward(self, timesteps: torch.Tensor, pooled: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        emb = self.time_embedding(timestep_embedding(timesteps, self.base_channels).to(dtype))
        if self.add_embedding is not None and pooled is not None:
            emb = emb + self.add_embedding(pooled.to(dtype))
        return emb


class OutputHead(nn.Module):
    """GroupNorm, SiLU, 3x3 conv back to the latent channels."""

    def __init__(self, channels: int, out_channels: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-5)
        self.conv = nn.Conv2d(channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.silu(self.norm(x)))
