"""Convolutional pieces shared by the UNet and the VAE: resnet blocks, resampling, spatial self-attention.

The parameter layouts follow diffusers' `ResnetBlock2D`, `Downsample2D`, `Upsample2D` and the VAE mid-block
attention, so that the presets have the parameter counts of the real models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Attention


class ResnetBlock2D(nn.Module):
    """GroupNorm-SiLU-conv twice, with an optional timestep-embedding shift and a 1x1 shortcut when widths differ."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        temb_channels: int | None,
        groups: int,
        eps: float = 1e-6,
    ):
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
