"""UNet: a conditional UNet denoiser in diffusers' `UNet2DConditionModel` (SDXL) layout.

Its call, shared with `DiT`: `denoiser(latents, timestep, encoder_hidden_states, pooled=None)`. `pooled` is
SDXL's added conditioning, required exactly when the config sets `pooled_projection_dim`; SDXL's `time_ids`
are left out (they would widen that call)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import PositiveInt, model_validator
from torch import nn

from ...folder.class_registry import library_class
from ...framework.modeling import ModelConfig, ModelMixin
from .layers import (
    Activation,
    Attention,
    Downsample2D,
    FeedForward,
    MLPEmbedding,
    ResnetBlock2D,
    Upsample2D,
    check_denoiser_inputs,
    timestep_embedding,
    timesteps_for_batch,
)


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
    """Resnets (each followed by a transformer when `depth > 0`), then an optional downsample."""

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
    """Resnets fed with the running state and a skip state, then an optional upsample. In `_no_split_modules`:
    cut across devices, its concatenation would see tensors on two devices."""

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
    """Timestep embedding plus the projected pooled text: one module, so a device map never splits the sum."""

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


class UNetConfig(ModelConfig):
    in_channels: PositiveInt = 4
    out_channels: PositiveInt = 4
    block_out_channels: tuple[PositiveInt, ...] = (320, 640, 1280)
    layers_per_block: PositiveInt = 2
    # Transformer depth per resolution level (0: that level has resnets only, like SDXL's first level).
    transformer_layers_per_block: tuple[int, ...] = (0, 2, 10)
    mid_transformer_layers: int = 10
    attention_head_dim: PositiveInt = 64
    cross_attention_dim: PositiveInt = 2048
    pooled_projection_dim: PositiveInt | None = 1280
    norm_num_groups: PositiveInt = 32

    @model_validator(mode="after")
    def _consistent(self):
        if len(self.transformer_layers_per_block) != len(self.block_out_channels):
            raise ValueError(
                f"transformer_layers_per_block has {len(self.transformer_layers_per_block)} entries but "
                f"block_out_channels has {len(self.block_out_channels)}; give one depth per level"
            )
        if any(depth < 0 for depth in self.transformer_layers_per_block) or self.mid_transformer_layers < 0:
            raise ValueError("transformer depths must be >= 0")
        for channels in self.block_out_channels:
            if channels % self.norm_num_groups or channels % self.attention_head_dim:
                raise ValueError(
                    f"block_out_channels entry {channels} must be a multiple of norm_num_groups "
                    f"({self.norm_num_groups}) and of attention_head_dim ({self.attention_head_dim})"
                )
        return self


@library_class
class UNet(ModelMixin):
    config_class = UNetConfig
    # UpBlock: it concatenates skips inside its forward (never cut it). The rest: the units of a device map.
    _no_split_modules = ["UpBlock", "ResnetBlock2D", "Transformer2D", "BasicTransformerBlock", "TimestepConditioning"]
    presets: ClassVar[dict[str, UNetConfig]] = {
        "tiny": UNetConfig(
            block_out_channels=(8, 16), layers_per_block=1, transformer_layers_per_block=(0, 1),
            mid_transformer_layers=1, attention_head_dim=8, cross_attention_dim=32, pooled_projection_dim=32,
            norm_num_groups=4,
        ),
        # SD 1.x-like: no pooled conditioning, attention at three levels, 768-wide text (CLIP-L): ~860M.
        "sd15": UNetConfig(
            block_out_channels=(320, 640, 1280, 1280), transformer_layers_per_block=(1, 1, 1, 0),
            mid_transformer_layers=1, attention_head_dim=40, cross_attention_dim=768, pooled_projection_dim=None,
        ),
        # SDXL base: ~2.6B.
        "sdxl": UNetConfig(),
    }

    def __init__(self, config: UNetConfig):
        super().__init__(config)
        channels, groups = config.block_out_channels, config.norm_num_groups
        temb = 4 * channels[0]
        common = dict(head_dim=config.attention_head_dim, cross_attention_dim=config.cross_attention_dim,
                      temb_channels=temb, groups=groups)
        self.conditioning = TimestepConditioning(channels[0], temb, config.pooled_projection_dim)
        self.conv_in = nn.Conv2d(config.in_channels, channels[0], 3, padding=1)

        skip_channels = [channels[0]]  # the conv_in output is the first skip
        self.down_blocks = nn.ModuleList()
        for level, (width, depth) in enumerate(zip(channels, config.transformer_layers_per_block)):
            block = DownBlock(channels[max(level - 1, 0)], width, num_layers=config.layers_per_block, depth=depth,
                              add_downsample=level < len(channels) - 1, **common)
            self.down_blocks.append(block)
            skip_channels += [width] * block.num_skips

        self.mid_block = MidBlock(channels[-1], depth=config.mid_transformer_layers, **common)

        self.up_blocks = nn.ModuleList()
        width_in = channels[-1]
        for level in reversed(range(len(channels))):
            count = config.layers_per_block + 1
            skips, skip_channels = skip_channels[-count:], skip_channels[:-count]
            self.up_blocks.append(UpBlock(width_in, list(reversed(skips)), channels[level],
                                          depth=config.transformer_layers_per_block[level],
                                          add_upsample=level > 0, **common))
            width_in = channels[level]
        self.head = OutputHead(channels[0], config.out_channels, groups)

    @property
    def downsampling_factor(self) -> int:
        return 2 ** (len(self.config.block_out_channels) - 1)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor | float | int,
                encoder_hidden_states: torch.Tensor, pooled: torch.Tensor | None = None) -> torch.Tensor:
        check_denoiser_inputs(type(self).__name__, self.config, latents, encoder_hidden_states, pooled,
                              spatial_multiple=self.downsampling_factor, text_dim_field="cross_attention_dim")
        timesteps = timesteps_for_batch(type(self).__name__, timestep, latents.shape[0], latents.device)
        temb = self.conditioning(timesteps, pooled, latents.dtype)

        x = self.conv_in(latents)
        skips: list[torch.Tensor] = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, encoder_hidden_states)
            skips.extend(block_skips)
        x = self.mid_block(x, temb, encoder_hidden_states)
        for block in self.up_blocks:
            count = len(block.resnets)
            block_skips, skips = tuple(skips[-count:]), skips[:-count]
            x = block(x, block_skips, temb, encoder_hidden_states)
        return self.head(x)
