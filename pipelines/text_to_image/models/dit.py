"""DiT: an MMDiT/Flux-like diffusion transformer denoiser.

Denoiser interface (the same as `UNet`'s; the pipeline calls nothing else):
    `denoiser(latents, timestep, encoder_hidden_states, pooled=None) -> Tensor` of the latents' shape.
- `latents` (B, in_channels, H, W) in image layout; H and W multiples of `patch_size`. The model patchifies
  them itself into (H/p * W/p) tokens of in_channels * p * p features, and unpatchifies its output.
- `timestep`: a number, a 0-d or a (B,) tensor, in the scheduler's scale (0 .. num_train_timesteps).
- `encoder_hidden_states` (B, S, config.joint_attention_dim): the text tokens (T5 states for Flux).
- `pooled` (B, config.pooled_projection_dim): the pooled text embedding (CLIP's for Flux); required when the
  config sets `pooled_projection_dim`, refused otherwise.

Flux-dev's guidance embedding is left out: the reference pipeline uses classifier-free guidance.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import PositiveFloat, PositiveInt, model_validator
from torch import nn

from ...framework.modeling import ModelConfig, ModelMixin
from .dit_blocks import DoubleStreamBlock, OutputLayer, SingleStreamBlock, TimeTextConditioning, sincos_position_embedding
from .inputs import check_denoiser_inputs, timesteps_for_batch
from ...folder.class_registry import library_class


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
    """Patchify, joint text-image (double-stream) blocks, single-stream blocks over [text; image], adaLN
    modulation from timestep + pooled text, unpatchify."""

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

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        pooled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_inputs(latents, encoder_hidden_states, pooled)
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
        """The inverse of `patchify`."""
        p, channels = self.config.patch_size, self.config.in_channels
        batch = tokens.shape[0]
        x = tokens.reshape(batch, height // p, width // p, channels, p, p)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)

    def _check_inputs(self, latents, encoder_hidden_states, pooled) -> None:
        check_denoiser_inputs(
            type(self).__name__, self.config, latents, encoder_hidden_states, pooled,
            spatial_multiple=self.config.patch_size, text_dim_field="joint_attention_dim",
        )
