"""Image DiTs: SD3/SD3.5, FLUX.1, PixArt-Sigma, Sana, Qwen-Image, HiDream-I1, AuraFlow.

Classifier-free guidance: SD3, PixArt, Sana, HiDream and AuraFlow batch negatives with prompts when guidance_scale > 1
(the transformer's batch doubles). FLUX.1 is guidance-distilled (guidance_scale is an embedding input, one
pass) and Qwen-Image's "true CFG" runs the negative pass as a second call of the same size: neither doubles.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from .shapes import config_value, float32, floats, spatial_factor, tokens
from .spec import CallSpec, ExampleCall
from .text_encoders import clip_length, present, text_call
from .unet_families import vae_decode

Calls = dict[str, tuple[ExampleCall, ...]]


def patch_pixel_step(modules: Mapping[str, nn.Module]) -> int:
    """Pixels per transformer token along a side: the VAE's factor times the patch size."""
    return spatial_factor(modules["vae"]) * config_value(modules["transformer"], "patch_size", default=1)


def packed_pixel_step(modules: Mapping[str, nn.Module]) -> int:
    """FLUX packs 2x2 latent cells into one token in the pipeline (its transformer's patch_size is 1)."""
    return spatial_factor(modules["vae"]) * 2


def _latent_grid(modules, spec: CallSpec) -> tuple[int, int]:
    factor = spatial_factor(modules["vae"])
    return spec.height // factor, spec.width // factor


def stable_diffusion_3(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusion3Pipeline: two CLIPs (77 tokens) and T5 (max_sequence_length) joined into one sequence."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (vae_decode(vae, spec),)}
    clip_tokens = 77
    for name, encoder in present(modules, "text_encoder", "text_encoder_2"):
        clip_tokens = clip_length(encoder)
        calls[name] = (text_call(encoder, spec.batch_size, clip_tokens, hidden_states=True),)
    for name, encoder in present(modules, "text_encoder_3"):  # without T5: zeros of the same length instead
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    kwargs = {
        "timestep": floats(transformer, batch),
        "encoder_hidden_states": floats(transformer, batch, clip_tokens + spec.max_sequence_length,
                                        transformer.config.joint_attention_dim),
        "pooled_projections": floats(transformer, batch, transformer.config.pooled_projection_dim),
    }
    latents = floats(transformer, batch, transformer.config.in_channels, *_latent_grid(modules, spec))
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def flux(modules: Mapping[str, nn.Module], spec: CallSpec, *, context_tokens: int = 0) -> Calls:
    """FluxPipeline: 2x2-packed latent tokens with 3-d position ids; CLIP pooled + T5 sequence; no doubling.
    `context_tokens`: packed tokens of a conditioning image appended to the latents' (Kontext)."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (vae_decode(vae, spec),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, clip_length(encoder)),)
    for name, encoder in present(modules, "text_encoder_2"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length),)
    batch, text_length = spec.images, spec.max_sequence_length
    image_tokens = packed_tokens(modules, spec) + context_tokens
    kwargs = {
        "encoder_hidden_states": floats(transformer, batch, text_length, transformer.config.joint_attention_dim),
        "pooled_projections": floats(transformer, batch, transformer.config.pooled_projection_dim),
        "timestep": floats(transformer, batch),
        "img_ids": floats(transformer, image_tokens, 3),
        "txt_ids": floats(transformer, text_length, 3),
        "return_dict": False,
    }
    if transformer.config.guidance_embeds:
        kwargs["guidance"] = float32(batch)
    latents = floats(transformer, batch, image_tokens, transformer.config.in_channels)
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def packed_tokens(modules: Mapping[str, nn.Module], spec: CallSpec) -> int:
    """FLUX's image tokens: one per 2x2 latent cells."""
    rows, cols = (side // 2 for side in _latent_grid(modules, spec))
    return rows * cols


def _masked_t5_transformer(modules, spec: CallSpec, **extra) -> Calls:
    """PixArt-Sigma and Sana: one masked text encoder, a transformer with an encoder attention mask, CFG doubled."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (vae_decode(vae, spec),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length, mask=True),)
    batch, length = spec.denoiser_batch(cfg_doubles=True), spec.max_sequence_length
    kwargs = {
        "encoder_hidden_states": floats(transformer, batch, length, transformer.config.caption_channels),
        "encoder_attention_mask": tokens(batch, length),
        "timestep": floats(transformer, batch),
        "return_dict": False,
        **extra,
    }
    latents = floats(transformer, batch, transformer.config.in_channels, *_latent_grid(modules, spec))
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def aura_flow(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """AuraFlowPipeline: UMT5 (max_sequence_length, masked), latents (N, C, H/8, W/8), CFG doubled."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (vae_decode(vae, spec),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length, mask=True),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    kwargs = {
        "encoder_hidden_states": floats(transformer, batch, spec.max_sequence_length,
                                        transformer.config.joint_attention_dim),
        "timestep": floats(transformer, batch),
        "return_dict": False,
    }
    latents = floats(transformer, batch, transformer.config.in_channels, *_latent_grid(modules, spec))
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def pixart_sigma(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """PixArtSigmaPipeline: T5 (300 tokens, masked); no resolution conditioning."""
    return _masked_t5_transformer(modules, spec, added_cond_kwargs={"resolution": None, "aspect_ratio": None})


def sana(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """SanaPipeline: Gemma2 (masked) and a linear-attention DiT on DC-AE latents (H/32).

    Approximation: the pipeline prepends its "complex human instruction" to every prompt and keeps the last
    max_sequence_length states; the encoder's call is counted at max_sequence_length tokens (the instruction's
    length depends on the tokenizer, which planning does not load), so it is a lower bound for the encoder.
    """
    return _masked_t5_transformer(modules, spec)


def qwen_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """QwenImagePipeline: Qwen2.5-VL's last hidden states (a 34-token template dropped), packed latents."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (_video_vae_image_decode(vae, spec),)}
    length = spec.max_sequence_length
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, length + 34, mask=True, hidden_states=True),)
    batch = spec.images  # true CFG runs the negative prompt as a second pass of the same size
    rows, cols = (side // 2 for side in _latent_grid(modules, spec))
    kwargs = {
        "timestep": floats(transformer, batch),
        "encoder_hidden_states_mask": tokens(batch, length),
        "encoder_hidden_states": floats(transformer, batch, length, transformer.config.joint_attention_dim),
        "img_shapes": [[(1, rows, cols)]] * batch,
        "return_dict": False,
    }
    if config_value(transformer, "guidance_embeds", default=False):
        kwargs["guidance"] = float32(batch)
    latents = floats(transformer, batch, rows * cols, transformer.config.in_channels)
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def _video_vae_image_decode(vae: nn.Module, spec: CallSpec) -> ExampleCall:
    """Qwen-Image's VAE is a causal video VAE: an image is one latent frame (N, C, 1, H/8, W/8)."""
    factor = spatial_factor(vae)
    latents = floats(vae, spec.images, vae.config.z_dim, 1, spec.height // factor, spec.width // factor)
    return ExampleCall(args=(latents,), method="decode")


def hidream(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """HiDreamImagePipeline: two CLIPs (pooled), T5 and Llama-3.1 (every layer's states), a MoE DiT, CFG doubled."""
    transformer, vae = modules["transformer"], modules["vae"]
    calls: Calls = {"vae": (vae_decode(vae, spec),)}
    length = spec.max_sequence_length
    for name, encoder in present(modules, "text_encoder", "text_encoder_2"):
        calls[name] = (text_call(encoder, spec.batch_size, clip_length(encoder, min(length, 218)),
                                 hidden_states=True),)
    for name, encoder in present(modules, "text_encoder_3"):
        calls[name] = (text_call(encoder, spec.batch_size, length, mask=True),)
    # The pipeline stacks every Llama layer's states; the transformer picks its `llama_layers` from the stack.
    layers = max(transformer.config.llama_layers) + 1
    for name, encoder in present(modules, "text_encoder_4"):
        layers = encoder.config.num_hidden_layers
        calls[name] = (text_call(encoder, spec.batch_size, length, mask=True, hidden_states=True,
                                 output_attentions=True),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    t5_dim, llama_dim = transformer.config.caption_channels
    kwargs = {
        "timesteps": floats(transformer, batch),
        "encoder_hidden_states_t5": floats(transformer, batch, length, t5_dim),
        "encoder_hidden_states_llama3": floats(transformer, layers, batch, length, llama_dim),
        "pooled_embeds": floats(transformer, batch, transformer.config.text_emb_dim),
        "return_dict": False,
    }
    latents = floats(transformer, batch, transformer.config.in_channels, *_latent_grid(modules, spec))
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls
