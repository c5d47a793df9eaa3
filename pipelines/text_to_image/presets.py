"""Named TextToImagePipeline configurations: tiny ones for tests and the demo, real-size ones for planning.

- "tiny-unet": one tiny CLIP-like encoder + tiny UNet + tiny VAE.
- "tiny-dit": tiny CLIP-like + tiny T5-like encoders + tiny DiT + tiny VAE (the Flux layout in miniature).
- "sdxl-like": CLIP-L + CLIP-bigG + the SDXL UNet (~2.6B) + the SDXL VAE.
- "flux-like": CLIP-L + T5-XXL (~4.7B) + the Flux DiT (~12B) + the Flux VAE.
Weights are random (seeded), so images are noise; shapes, sizes and mechanics are the real ones."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..errors import LoadError

from ..framework.modeling import ModelConfig
from .models import AutoencoderKL, DiT, TextEncoder, UNet
from .schedulers import FlowMatchEulerScheduler, FlowMatchEulerSchedulerConfig
from .tokenizers import ByteTokenizer


@dataclass(frozen=True, kw_only=True)
class PipelinePreset:
    text_encoder: ModelConfig
    text_encoder_2: ModelConfig | None
    denoiser_class: type
    denoiser: ModelConfig
    vae: ModelConfig
    scheduler: FlowMatchEulerSchedulerConfig


PRESETS: dict[str, PipelinePreset] = {
    "tiny-unet": PipelinePreset(
        text_encoder=TextEncoder.presets["tiny"], text_encoder_2=None, denoiser_class=UNet,
        denoiser=UNet.presets["tiny"], vae=AutoencoderKL.presets["tiny"],
        scheduler=FlowMatchEulerSchedulerConfig(),
    ),
    "tiny-dit": PipelinePreset(
        text_encoder=TextEncoder.presets["tiny"], text_encoder_2=TextEncoder.presets["tiny-t5"], denoiser_class=DiT,
        denoiser=DiT.presets["tiny"], vae=AutoencoderKL.presets["tiny"],
        scheduler=FlowMatchEulerSchedulerConfig(shift=3.0),
    ),
    "sdxl-like": PipelinePreset(
        text_encoder=TextEncoder.presets["clip-l"], text_encoder_2=TextEncoder.presets["clip-g"], denoiser_class=UNet,
        denoiser=UNet.presets["sdxl"], vae=AutoencoderKL.presets["sdxl"],
        scheduler=FlowMatchEulerSchedulerConfig(),
    ),
    "flux-like": PipelinePreset(
        text_encoder=TextEncoder.presets["clip-l"], text_encoder_2=TextEncoder.presets["t5-xxl"], denoiser_class=DiT,
        denoiser=DiT.presets["flux"], vae=AutoencoderKL.presets["flux"],
        scheduler=FlowMatchEulerSchedulerConfig(shift=3.0),
    ),
}
DEVICES = ("cpu", "meta")


def preset(name: str) -> PipelinePreset:
    if name not in PRESETS:
        raise LoadError(f"Unknown preset {name!r}; the presets are {', '.join(PRESETS)}.")
    return PRESETS[name]


def build_preset_components(name: str, *, device: str = "cpu", seed: int = 0) -> dict:
    """Random weights from `seed` on the CPU, or no memory at all on meta."""
    spec = preset(name)
    if device not in DEVICES:
        raise LoadError(
            f"from_preset(device={device!r}): presets are built on {' or '.join(DEVICES)}; build on 'cpu' and "
            "call .to(...), or save the pipeline and load it with device_map=... to place it."
        )
    with torch.random.fork_rng(devices=[]):  # seeded, without disturbing the caller's global RNG
        torch.manual_seed(seed)
        # torch.device("meta") allocates nothing, not even transiently (init_empty_weights allocates each
        # parameter on the CPU first: seconds for T5-XXL). Buffers land on meta too: fine for planning.
        with torch.device("meta") if device == "meta" else nullcontext(), \
                NoInitOnMeta() if device == "meta" else nullcontext():
            modules = {
                "text_encoder": TextEncoder(spec.text_encoder),
                "text_encoder_2": TextEncoder(spec.text_encoder_2) if spec.text_encoder_2 is not None else None,
                "denoiser": spec.denoiser_class(spec.denoiser),
                "vae": AutoencoderKL(spec.vae),
            }
    for module in modules.values():
        if module is not None:
            module.eval()
    return {**modules, "scheduler": FlowMatchEulerScheduler(spec.scheduler), "tokenizer": ByteTokenizer()}


class NoInitOnMeta(TorchFunctionMode):
    """Skips in-place initialisation of meta tensors, which writes nothing yet runs torch's Python reference kernel
    (~0.5 s for flux-like's 1,400 `reset_parameters` calls, 10 times the build itself)."""

    _IN_PLACE = frozenset({torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        initialises = func in self._IN_PLACE or getattr(func, "__module__", None) == "torch.nn.init"
        if initialises and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)

