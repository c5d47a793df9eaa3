"""UNet: a conditional UNet denoiser (Stable Diffusion / SDXL architecture).

Denoiser interface (shared with `DiT`; the pipeline calls nothing else):
    `denoiser(latents, timestep, encoder_hidden_states, pooled=None) -> Tensor` of the latents' shape.
- `latents` (B, in_channels, H, W), H and W multiples of `downsampling_factor`.
- `timestep`: a number, a 0-d or a (B,) tensor, in the scheduler's scale (0 .. num_train_timesteps).
- `encoder_hidden_states` (B, S, config.cross_attention_dim): the text states the transformers attend to.
- `pooled` (B, config.pooled_projection_dim): the pooled text embedding added to the timestep embedding
  (SDXL's added conditioning); required when the config sets `pooled_projection_dim`, refused otherwise.
  SDXL's micro-conditioning on image sizes (its `time_ids`) is left out: it is a few hundred thousand
  parameters and would widen the denoiser interface.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import PositiveInt, model_validator
from torch import nn

from ...framework.modeling import ModelConfig, ModelMixin
from .inputs import check_denoiser_inputs, timesteps_for_batch
from .unet_blocks import DownBlock, MidBlock, OutputHead, TimestepConditioning, UpBlock
from ...folder.class_registry import library_class


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
    """Timestep conditioning, down blocks (resnets + cross-attention transformers), mid block, up blocks that
    concatenate the down path's skip states, output head."""

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
        """Latent height and width must be multiples of this."""
        return 2 ** (len(self.config.block_out_channels) - 1)

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        pooled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_inputs(latents, encoder_hidden_states, pooled)
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

    def _check_inputs(self, latents, encoder_hidden_states, pooled) -> None:
        check_denoiser_inputs(
            type(self).__name__, self.config, latents, encoder_hidden_states, pooled,
            spatial_multiple=self.downsampling_factor, text_dim_field="cross_attention_dim",
        )
