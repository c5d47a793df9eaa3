"""Stable Diffusion 1.x/2.x and SDXL: CLIP text encoders, a UNet on (C, H/8, W/8) latents, an AutoencoderKL.

Both pipelines batch the negative prompts with the prompts (classifier-free guidance) when guidance_scale > 1:
the UNet's batch is doubled; the text encoders encode prompts and negatives in two calls of `batch_size` each.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from .shapes import config_value, floats, spatial_factor
from .spec import CallSpec, ExampleCall
from .text_encoders import clip_length, present, text_call


def unet_pixel_step(modules: Mapping[str, nn.Module]) -> int:
    return spatial_factor(modules["vae"])


def vae_decode(vae: nn.Module, spec: CallSpec) -> ExampleCall:
    """`vae.decode(latents)` on one latent per image (the pipelines decode the whole batch at once)."""
    factor = spatial_factor(vae)
    latents = floats(vae, spec.images, vae.config.latent_channels, spec.height // factor, spec.width // factor)
    return ExampleCall(args=(latents,), method="decode")


def _unet_latents(unet: nn.Module, vae: nn.Module, spec: CallSpec, batch: int):
    factor = spatial_factor(vae)
    return floats(unet, batch, unet.config.in_channels, spec.height // factor, spec.width // factor)


def stable_diffusion(modules: Mapping[str, nn.Module], spec: CallSpec) -> dict[str, tuple[ExampleCall, ...]]:
    """StableDiffusionPipeline (1.x and 2.x): `unet(latents, t, encoder_hidden_states=...)`."""
    unet, vae = modules["unet"], modules["vae"]
    calls: dict[str, tuple[ExampleCall, ...]] = {"vae": (vae_decode(vae, spec),)}
    length = 77
    for name, encoder in present(modules, "text_encoder"):
        length = clip_length(encoder)
        # SD 1.x/2.x configs may ask for the mask (use_attention_mask); the default is without.
        calls[name] = (text_call(encoder, spec.batch_size, length),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    text = floats(unet, batch, length, unet.config.cross_attention_dim)
    calls["unet"] = (ExampleCall(args=(_unet_latents(unet, vae, spec, batch), floats(unet)),
                                 kwargs={"encoder_hidden_states": text}),)
    return calls


def stable_diffusion_xl(modules: Mapping[str, nn.Module], spec: CallSpec) -> dict[str, tuple[ExampleCall, ...]]:
    """StableDiffusionXLPipeline: both CLIPs' penultimate states concatenated; pooled text + 6 time ids."""
    unet, vae = modules["unet"], modules["vae"]
    calls: dict[str, tuple[ExampleCall, ...]] = {"vae": (vae_decode(vae, spec),)}
    for name, encoder in present(modules, "text_encoder", "text_encoder_2"):
        calls[name] = (text_call(encoder, spec.batch_size, clip_length(encoder), hidden_states=True),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    text = floats(unet, batch, 77, unet.config.cross_attention_dim)
    # text_embeds: text_encoder_2's projection; time_ids: original size, crop, target size (2 each).
    pooled_dim = config_value(unet, "projection_class_embeddings_input_dim") - 6 * unet.config.addition_time_embed_dim
    added = {"text_embeds": floats(unet, batch, pooled_dim), "time_ids": floats(unet, batch, 6)}
    calls["unet"] = (ExampleCall(args=(_unet_latents(unet, vae, spec, batch), floats(unet)),
                                 kwargs={"encoder_hidden_states": text, "added_cond_kwargs": added}),)
    return calls
