"""Tiny reference models and matching inputs for the model tests (seeded, CPU, eval mode)."""

from __future__ import annotations

import torch

from pipelines.text_to_image.models import AutoencoderKL, DiT, TextEncoder, UNet


def tiny(cls, preset: str = "tiny", seed: int = 0):
    torch.manual_seed(seed)
    return cls.from_config(cls.presets[preset]).eval()


def text_inputs(model: TextEncoder, batch: int = 2, length: int = 12, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length // 2:] = 0  # the last row is padded
    return ids, mask


def denoiser_inputs(model: UNet | DiT, batch: int = 2, size: int = 8, tokens: int = 5, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    width = getattr(config, "cross_attention_dim", None) or config.joint_attention_dim
    latents = torch.randn(batch, config.in_channels, size, size, generator=generator)
    context = torch.randn(batch, tokens, width, generator=generator)
    pooled = torch.randn(batch, config.pooled_projection_dim, generator=generator)
    timestep = torch.tensor([250.0, 750.0][:batch] + [500.0] * max(0, batch - 2))
    return latents, timestep, context, pooled


def run(model, *, seed: int = 3):
    """One forward of a tiny reference model on fixed inputs (what the round-trip tests compare)."""
    with torch.no_grad():
        if isinstance(model, TextEncoder):
            return model(*text_inputs(model, seed=seed)).last_hidden_state
        if isinstance(model, AutoencoderKL):
            images = torch.randn(2, model.config.in_channels, 16, 16, generator=torch.Generator().manual_seed(seed))
            return model(images)
        return model(*denoiser_inputs(model, seed=seed))
