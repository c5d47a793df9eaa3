"""Meta tensors of a component's input shapes, and the shape facts read from component configs."""

from __future__ import annotations

import torch
from torch import nn

_META = torch.device("meta")


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: its first floating parameter's (float32 when it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def floats(module: nn.Module, *shape: int) -> torch.Tensor:
    """A meta tensor in `module`'s dtype: what the pipeline casts its inputs to (`estimate(dtype=)` recasts)."""
    return torch.empty(shape, dtype=module_dtype(module), device=_META)


def float32(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=_META)


def tokens(*shape: int) -> torch.Tensor:
    """Token ids or an attention mask (int64)."""
    return torch.empty(shape, dtype=torch.long, device=_META)


def config_value(module: nn.Module, *names: str, default=None):
    """The first of `names` the module's config has (diffusers FrozenDict or transformers PretrainedConfig)."""
    config = module.config
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _own_or_config(module: nn.Module, *names: str):
    # Some VAEs derive a ratio in __init__ (LTX, DC-AE) and leave the config's None; the attribute is the truth.
    for name in names:
        if isinstance(module.__dict__.get(name), int):
            return module.__dict__[name]
    return config_value(module, *names)


def spatial_factor(vae: nn.Module) -> int:
    """Pixels per latent cell along a side: diffusers' `vae_scale_factor` for this VAE class."""
    explicit = _own_or_config(vae, "spatial_compression_ratio", "scale_factor_spatial")
    if explicit is not None:
        return int(explicit)
    if config_value(vae, "temperal_downsample") is not None:  # Wan / Qwen-Image VAEs: one halving per flag
        return 2 ** len(config_value(vae, "temperal_downsample"))
    channels = config_value(vae, "block_out_channels", "encoder_block_out_channels")
    return 2 ** (len(channels) - 1)


def temporal_factor(vae: nn.Module) -> int:
    """Frames per latent frame (video VAEs)."""
    explicit = _own_or_config(vae, "temporal_compression_ratio", "scale_factor_temporal")
    if explicit is not None:
        return int(explicit)
    downsample = config_value(vae, "temperal_downsample")
    return 2 ** sum(bool(flag) for flag in downsample) if downsample is not None else 1


def latent_frames(num_frames: int, vae: nn.Module) -> int:
    """Latent frames of a video of `num_frames` (the first frame alone, then one per temporal step)."""
    return (num_frames - 1) // temporal_factor(vae) + 1
