"""Encoder, decoder and posterior of the KL autoencoder (diffusers' `AutoencoderKL` layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .conv_blocks import Downsample2D, ResnetBlock2D, SpatialSelfAttention, Upsample2D


class VAEMidBlock(nn.Module):
    """Resnet, single-head self-attention over all pixels, resnet."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.resnet_in = ResnetBlock2D(channels, channels, temb_channels=None, groups=groups)
        self.attention = SpatialSelfAttention(channels, groups=groups)
        self.resnet_out = ResnetBlock2D(channels, channels, temb_channels=None, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnet_out(self.attention(self.resnet_in(x)))


class ResampleBlock(nn.Module):
    """`num_layers` resnets then a down- or upsample (or neither, for the last level)."""

    def __init__(self, in_channels: int, out_channels: int, *, num_layers: int, groups: int,
                 resample: type[nn.Module] | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb_channels=None, groups=groups)
            for i in range(num_layers)
        )
        self.resample = resample(out_channels) if resample is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.resample is None else self.resample(x)


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) -> posterior moments (B, 2*latent_channels, H/f, W/f)."""

    def __init__(self, in_channels: int, latent_channels: int, channels: tuple[int, ...], layers: int, groups: int):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResampleBlock(channels[max(i - 1, 0)], width, num_layers=layers, groups=groups,
                          resample=Downsample2D if i < len(channels) - 1 else None)
            for i, width in enumerate(channels)
        )
        self.mid_block = VAEMidBlock(channels[-1], groups)
        self.norm_out = nn.GroupNorm(groups, channels[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(channels[-1], 2 * latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Decoder(nn.Module):
    """Latents (B, latent_channels, h, w) -> image (B, out_channels, h*f, w*f)."""

    def __init__(self, latent_channels: int, out_channels: int, channels: tuple[int, ...], layers: int, groups: int):
        super().__init__()
        reversed_channels = tuple(reversed(channels))
        self.conv_in = nn.Conv2d(latent_channels, reversed_channels[0], 3, padding=1)
        self.mid_block = VAEMidBlock(reversed_channels[0], groups)
        self.up_blocks = nn.ModuleList(
            ResampleBlock(reversed_channels[max(i - 1, 0)], width, num_layers=layers + 1, groups=groups,
                          resample=Upsample2D if i < len(channels) - 1 else None)
            for i, width in enumerate(reversed_channels)
        )
        self.norm_out = nn.GroupNorm(groups, channels[0], eps=1e-6)
        self.conv_out = nn.Conv2d(channels[0], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


@dataclass(frozen=True, kw_only=True)
class DiagonalGaussian:
    """The encoder's posterior: a diagonal Gaussian per latent element.

    `sample(generator)` draws latents, `mode()` is the mean; both are unscaled (multiply by the VAE's
    `scaling_factor` after subtracting `shift_factor` before handing them to a denoiser).
    """

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> "DiagonalGaussian":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean=mean, logvar=logvar.clamp(-30.0, 20.0))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        # Draw on the generator's device (a CPU generator gives the same latents on every machine), then move.
        device = generator.device if generator is not None else self.mean.device
        noise = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * noise.to(self.mean.device)

    def to(self, *args, **kwargs) -> "DiagonalGaussian":
        """Moved/cast like a tensor (accelerate's hooks call `.to(device)` on outputs that have it)."""
        return DiagonalGaussian(mean=self.mean.to(*args, **kwargs), logvar=self.logvar.to(*args, **kwargs))

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL divergence to N(0, I) per sample, summed over latent elements."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).sum(dim=(1, 2, 3))
