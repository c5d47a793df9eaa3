"""Activation peaks of the real pipelines' components at one common call, by `placement.estimate_activations`.

The common call: images 1024 x 1024, one per prompt; videos at their family's default (CogVideoX 49 frames
at 480 x 720, Wan 81 frames at 480 x 832); bf16. Classifier-free guidance doubles the denoiser's batch
(FLUX.1-dev is guidance-distilled: batch 1); text encoders run at the pipeline's default max sequence length
(CLIP 77 tokens, T5 256 for SD3, 300 for PixArt, 226 for CogVideoX, 512 for FLUX and Wan), batch 2 where the
pipeline encodes a negative prompt; the VAE decodes one latent. Each component's inputs are built on meta
from its config (`inputs_for`), and `estimate_activations` runs the forward (`decode` for a VAE) under fake
tensors: nothing is allocated. CogVideoX's transformer gets no rotary embedding (the pipeline builds it
outside; it adds two small tensors per call).

Estimating all 25 components takes a few minutes on two CPU cores, so the numbers are kept in
`data/real_activation_peaks.json`; `python benchmarks/placement_quality.py --estimate` rebuilds that file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import placement

DTYPE = torch.bfloat16
IMAGE_LATENT = 128  # 1024 px / 8
CFG = {"sd15": 2, "sdxl-base-1.0": 2, "sd3-medium": 2, "flux1-dev": 1, "pixart-sigma-1024": 2,
       "wan2.1-t2v-14b": 2, "wan2.1-t2v-1.3b": 2, "cogvideox-5b": 2}  # fmt: skip
TEXT_LENGTH = {"sd3-medium": 256, "flux1-dev": 512, "pixart-sigma-1024": 300, "wan2.1-t2v-14b": 512,
               "wan2.1-t2v-1.3b": 512, "cogvideox-5b": 226}  # fmt: skip
VIDEO_LATENT = {"cogvideox-5b": (13, 60, 90), "wan2.1-t2v-14b": (21, 60, 104), "wan2.1-t2v-1.3b": (21, 60, 104)}


def _meta(*shape, dtype=DTYPE) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, dtype=torch.long, device="meta")


def inputs_for(pipeline: str, cls: str, module: nn.Module) -> tuple[tuple, dict[str, Any], str]:
    """(args, kwargs, method) of the component's call in the common call."""
    batch = CFG[pipeline]
    config = getattr(module, "config", None)
    if cls.startswith("CLIPText"):
        return (_ids(batch, 77),), {}, "forward"
    if cls in ("T5EncoderModel", "UMT5EncoderModel"):
        return (_ids(batch, TEXT_LENGTH[pipeline]),), {}, "forward"
    if cls == "UNet2DConditionModel":
        kwargs: dict[str, Any] = {"encoder_hidden_states": _meta(batch, 77, config.cross_attention_dim)}
        if config.addition_embed_type == "text_time":
            text = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            kwargs["added_cond_kwargs"] = {"text_embeds": _meta(batch, text), "time_ids": _meta(batch, 6)}
        return (_meta(batch, config.in_channels, IMAGE_LATENT, IMAGE_LATENT), _meta(batch)), kwargs, "forward"
    if cls == "SD3Transformer2DModel":
        return (), {
            "hidden_states": _meta(batch, config.in_channels, IMAGE_LATENT, IMAGE_LATENT),
            "encoder_hidden_states": _meta(batch, 77 + TEXT_LENGTH[pipeline], config.joint_attention_dim),
            "pooled_projections": _meta(batch, config.pooled_projection_dim), "timestep": _meta(batch),
        }, "forward"  # fmt: skip
    if cls == "FluxTransformer2DModel":
        tokens, text = (IMAGE_LATENT // 2) ** 2, TEXT_LENGTH[pipeline]
        return (), {
            "hidden_states": _meta(batch, tokens, config.in_channels),
            "encoder_hidden_states": _meta(batch, text, config.joint_attention_dim),
            "pooled_projections": _meta(batch, config.pooled_projection_dim), "timestep": _meta(batch),
            "img_ids": _meta(tokens, 3), "txt_ids": _meta(text, 3), "guidance": _meta(batch),
        }, "forward"  # fmt: skip
    if cls == "PixArtTransformer2DModel":
        return (), {
            "hidden_states": _meta(batch, config.in_channels, IMAGE_LATENT, IMAGE_LATENT),
            "encoder_hidden_states": _meta(batch, TEXT_LENGTH[pipeline], config.caption_channels),
            "timestep": _meta(batch), "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        }, "forward"  # fmt: skip
    if cls == "WanTransformer3DModel":
        frames, height, width = VIDEO_LATENT[pipeline]
        return (), {
            "hidden_states": _meta(batch, config.in_channels, frames, height, width), "timestep": _meta(batch),
            "encoder_hidden_states": _meta(batch, TEXT_LENGTH[pipeline], config.text_dim),
        }, "forward"  # fmt: skip
    if cls == "CogVideoXTransformer3DModel":
        frames, height, width = VIDEO_LATENT[pipeline]
        return (), {
            "hidden_states": _meta(batch, frames, config.in_channels, height, width), "timestep": _meta(batch),
            "encoder_hidden_states": _meta(batch, TEXT_LENGTH[pipeline], config.text_embed_dim),
        }, "forward"  # fmt: skip
    if cls == "AutoencoderKL":
        return (_meta(1, config.latent_channels, IMAGE_LATENT, IMAGE_LATENT),), {}, "decode"
    if cls in ("AutoencoderKLWan", "AutoencoderKLCogVideoX"):
        frames, height, width = VIDEO_LATENT[pipeline]
        channels = getattr(config, "z_dim", None) or config.latent_channels
        return (_meta(1, channels, frames, height, width),), {}, "decode"
    raise SystemExit(f"no common-call inputs for {cls} ({pipeline}); add them to benchmarks/real_calls.py")


def estimate(pipeline: str, cls: str, module: nn.Module) -> int:
    args, kwargs, method = inputs_for(pipeline, cls, module)
    return placement.estimate_activations(module, args, kwargs, method=method, dtype=DTYPE)
