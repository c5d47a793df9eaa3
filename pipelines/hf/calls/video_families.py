"""Video DiTs: CogVideoX, HunyuanVideo, Wan 2.1 (T2V, I2V), LTX-Video.

Frames become latent frames through the VAE's temporal compression: (num_frames - 1) // t + 1. Guidance:
CogVideoX and LTX batch negatives with prompts (doubled); Wan runs the negative pass as a second call of the
same size, and HunyuanVideo is guidance-distilled (guidance is an embedding input): neither doubles.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from .shapes import config_value, float32, floats, latent_frames, spatial_factor, temporal_factor, tokens
from .spec import CallSpec, ExampleCall
from .text_encoders import clip_length, clip_vision_call, present, text_call

Calls = dict[str, tuple[ExampleCall, ...]]


def video_pixel_step(modules: Mapping[str, nn.Module]) -> int:
    """Pixels per transformer token along a side (patch size may be a (t, h, w) triple, as in Wan)."""
    patch = config_value(modules["transformer"], "patch_size", default=1)
    return spatial_factor(modules["vae"]) * (patch[-1] if isinstance(patch, (list, tuple)) else patch)


def grid(vae: nn.Module, spec: CallSpec) -> tuple[int, int, int]:
    """Latent frames, rows and columns of the call's video."""
    factor = spatial_factor(vae)
    return latent_frames(spec.num_frames, vae), spec.height // factor, spec.width // factor


def _video_decode(vae: nn.Module, spec: CallSpec, frames: int, rows: int, cols: int, channels: int,
                  **kwargs) -> ExampleCall:
    latents = floats(vae, spec.images, channels, frames, rows, cols)
    return ExampleCall(args=(latents,), kwargs=kwargs, method="decode")


def cogvideox(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """CogVideoXPipeline: T5 (226), latents (N, F', C, H/8, W/8), 3-d rotary embeddings when configured."""
    transformer, vae = modules["transformer"], modules["vae"]
    frames, rows, cols = grid(vae, spec)
    patch, patch_t = transformer.config.patch_size, config_value(transformer, "patch_size_t")
    if patch_t:  # CogVideoX 1.5 pads the latent frames to a multiple of its temporal patch
        frames += (-frames) % patch_t
    calls: Calls = {"vae": (_video_decode(vae, spec, frames, rows, cols, vae.config.latent_channels),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length),)
    batch = spec.denoiser_batch(cfg_doubles=True)
    kwargs = {
        "encoder_hidden_states": floats(transformer, batch, spec.max_sequence_length,
                                        transformer.config.text_embed_dim),
        "timestep": floats(transformer, batch),
        "return_dict": False,
    }
    if transformer.config.use_rotary_positional_embeddings:
        positions = (frames // (patch_t or 1)) * (rows // patch) * (cols // patch)
        head_dim = transformer.config.attention_head_dim
        kwargs["image_rotary_emb"] = (float32(positions, head_dim), float32(positions, head_dim))
    latents = floats(transformer, batch, frames, transformer.config.in_channels, rows, cols)
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def hunyuan_video(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """HunyuanVideoPipeline: Llama (a 95-token template + max_sequence_length, template cropped), CLIP pooled."""
    transformer, vae = modules["transformer"], modules["vae"]
    frames, rows, cols = grid(vae, spec)
    calls: Calls = {"vae": (_video_decode(vae, spec, frames, rows, cols, vae.config.latent_channels),)}
    length = spec.max_sequence_length
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, length + 95, mask=True, hidden_states=True),)
    for name, encoder in present(modules, "text_encoder_2"):
        calls[name] = (text_call(encoder, spec.batch_size, clip_length(encoder)),)
    batch = spec.images  # guidance-distilled; true CFG is a second pass of the same size
    kwargs = {
        "timestep": floats(transformer, batch),
        "encoder_hidden_states": floats(transformer, batch, length, transformer.config.text_embed_dim),
        "encoder_attention_mask": tokens(batch, length),
        "pooled_projections": floats(transformer, batch, transformer.config.pooled_projection_dim),
        "guidance": floats(transformer, batch),
        "return_dict": False,
    }
    latents = floats(transformer, batch, transformer.config.in_channels, frames, rows, cols)
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def wan_with(modules, spec: CallSpec, extra: Mapping) -> Calls:
    """Wan's calls; `extra`: {transformer kwarg: make(transformer, batch)} for the variants' inputs."""
    vae = modules["vae"]
    frames, rows, cols = grid(vae, spec)
    calls: Calls = {"vae": (_video_decode(vae, spec, frames, rows, cols, vae.config.z_dim),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length, mask=True),)
    batch = spec.images  # the negative prompt is a second transformer call of the same size
    for name, transformer in present(modules, "transformer", "transformer_2"):  # Wan 2.2: two experts
        kwargs = {
            "timestep": floats(transformer, batch),
            "encoder_hidden_states": floats(transformer, batch, spec.max_sequence_length,
                                            transformer.config.text_dim),
            "return_dict": False,
            **{key: make(transformer, batch) for key, make in extra.items()},
        }
        latents = floats(transformer, batch, transformer.config.in_channels, frames, rows, cols)
        calls[name] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls


def wan(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """WanPipeline (text to video): UMT5 (512, masked), latents (N, 16, F', H/8, W/8), causal video VAE."""
    return wan_with(modules, spec, {})


def wan_image_to_video(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """WanImageToVideoPipeline: as T2V, plus the image: the CLIP vision encoder's 257 penultimate states feed
    the transformer (Wan 2.1), and the VAE *encodes* the conditioning video (the image, then zeros) at full
    size before it decodes; its peak is the larger of the two."""
    extra = {}
    if config_value(modules["transformer"], "image_dim") is not None:
        vision = modules.get("image_encoder")
        positions = (config_value(vision, "image_size", default=224) // config_value(vision, "patch_size",
                                                                                       default=14)) ** 2 + 1 \
            if isinstance(vision, nn.Module) else 257
        image_dim = modules["transformer"].config.image_dim
        extra["encoder_hidden_states_image"] = lambda transformer, batch: floats(transformer, batch, positions,
                                                                                  image_dim)
    calls = wan_with(modules, spec, extra)
    for name, encoder in present(modules, "image_encoder"):
        calls[name] = (clip_vision_call(encoder, spec.batch_size),)
    vae = modules["vae"]
    video = floats(vae, spec.images, 3, spec.num_frames, spec.height, spec.width)
    calls["vae"] = (ExampleCall(args=(video,), method="encode"), *calls["vae"])
    return calls


def ltx_video(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """LTXPipeline: T5 (128), latents patchified to (N, F'*H/32*W/32, 128), CFG doubled; a 32x / 8x VAE."""
    transformer, vae = modules["transformer"], modules["vae"]
    frames, rows, cols = grid(vae, spec)
    channels = transformer.config.in_channels
    temb = floats(vae, spec.images) if config_value(vae, "timestep_conditioning", default=False) else None
    calls: Calls = {"vae": (_video_decode(vae, spec, frames, rows, cols, vae.config.latent_channels, temb=temb),)}
    for name, encoder in present(modules, "text_encoder"):
        calls[name] = (text_call(encoder, spec.batch_size, spec.max_sequence_length),)
    batch, length = spec.denoiser_batch(cfg_doubles=True), spec.max_sequence_length
    spatial, temporal = spatial_factor(vae), temporal_factor(vae)
    kwargs = {
        "encoder_hidden_states": floats(transformer, batch, length, transformer.config.caption_channels),
        "timestep": floats(transformer, batch),
        "encoder_attention_mask": tokens(batch, length),
        "num_frames": frames, "height": rows, "width": cols,
        "rope_interpolation_scale": (temporal / 25, spatial, spatial),  # 25 fps, the pipeline's default
        "return_dict": False,
    }
    latents = floats(transformer, batch, frames * rows * cols, channels)
    calls["transformer"] = (ExampleCall(args=(latents,), kwargs=kwargs),)
    return calls
