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
    """StableDiffusionXLPipeline (and the refiner, text_encoder_2 alone): both CLIPs' penultimate states
    concatenated; pooled text + 6 time ids (5 with the refiner's aesthetic score)."""
    unet, vae = modules["unet"], modules["vae"]
    calls: dict[str, tuple[ExampleCall, ...]] = {"vae": (vae_decode(vae, spec),)}
    length = 77
    for name, encoder in present(modules, "text_encoder", "text_encoder_2"):
        length = clip_length(encoder)
        calls[name] = (text_call(encoder, spec.batch_size, length, hidden_states=True),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    text = floats(unet, batch, length, unet.config.cross_attention_dim)
    calls["unet"] = (ExampleCall(args=(_unet_latents(unet, vae, spec, batch), floats(unet)),
                                 kwargs={"encoder_hidden_states": text,
                                         "added_cond_kwargs": sdxl_added_conditions(modules, batch)}),)
    return calls


def sdxl_added_conditions(modules: Mapping[str, nn.Module], batch: int) -> dict:
    """text_embeds: text_encoder_2's projection; time_ids: original size, crop, target size (2 each), or with the
    refiner (`requires_aesthetics_score`) original size, crop and the score: counted from the UNet's input."""
    unet = modules["unet"]
    total, per_id = config_value(unet, "projection_class_embeddings_input_dim"), unet.config.addition_time_embed_dim
    pooled = config_value(modules.get("text_encoder_2"), "projection_dim") \
        if isinstance(modules.get("text_encoder_2"), nn.Module) else None
    time_ids = (total - pooled) // per_id if pooled else 6
    return {"text_embeds": floats(unet, batch, total - time_ids * per_id), "time_ids": floats(unet, batch, time_ids)}


def image_encode(vae: nn.Module, spec: CallSpec) -> ExampleCall:
    """`vae.encode(image)` of the input image at the call's size, one per prompt (img2img, inpaint, control)."""
    channels = config_value(vae, "in_channels", default=3)
    return ExampleCall(args=(floats(vae, spec.batch_size, channels, spec.height, spec.width),), method="encode")
