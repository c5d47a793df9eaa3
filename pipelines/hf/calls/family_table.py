"""The table: diffusers pipeline class name -> how its call feeds each component, and the call's defaults.

Keyed by the class NAME (model_index.json's `_class_name`), so it serves a folder loaded as a generic pipeline
and one loaded as the diffusers class alike, and needs diffusers only to build the components. Defaults are
the pipeline's own `__call__` defaults (guidance_scale, max_sequence_length, num_frames), so a `call=` that
gives only height and width is planned as diffusers would run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

from . import dit_families, unet_families, video_families
from .spec import CallSpec, ExampleCall

Describe = Callable[[Mapping[str, nn.Module], CallSpec], dict[str, tuple[ExampleCall, ...]]]


@dataclass(frozen=True, kw_only=True)
class Family:
    """How one pipeline class calls its components: `describe`, the pixel step of its latent grid, defaults."""

    describe: Describe
    pixel_step: Callable[[Mapping[str, nn.Module]], int]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    video: bool = False
    denoiser: str = "transformer"

    @property
    def required(self) -> tuple[str, str]:
        """The components the latent shapes are read from."""
        return (self.denoiser, "vae")


def _image(describe: Describe, guidance: float, sequence: int | None = None, *, step=None) -> Family:
    defaults = {"guidance_scale": guidance, **({"max_sequence_length": sequence} if sequence else {})}
    if step is None:
        return Family(describe=describe, pixel_step=dit_families.patch_pixel_step, defaults=defaults)
    return Family(describe=describe, pixel_step=step, defaults=defaults, denoiser="unet")


def _video(describe: Describe, guidance: float, sequence: int, frames: int) -> Family:
    defaults = {"guidance_scale": guidance, "max_sequence_length": sequence, "num_frames": frames}
    return Family(describe=describe, pixel_step=video_families.video_pixel_step, defaults=defaults, video=True)


FAMILIES: dict[str, Family] = {
    "StableDiffusionPipeline": _image(unet_families.stable_diffusion, 7.5, step=unet_families.unet_pixel_step),
    "StableDiffusionXLPipeline": _image(unet_families.stable_diffusion_xl, 5.0, step=unet_families.unet_pixel_step),
    "StableDiffusion3Pipeline": _image(dit_families.stable_diffusion_3, 7.0, 256),
    "FluxPipeline": Family(describe=dit_families.flux, pixel_step=dit_families.packed_pixel_step,
                           defaults={"guidance_scale": 3.5, "max_sequence_length": 512}),
    "PixArtSigmaPipeline": _image(dit_families.pixart_sigma, 4.5, 300),
    "SanaPipeline": _image(dit_families.sana, 4.5, 300),
    "QwenImagePipeline": _image(dit_families.qwen_image, 1.0, 512),
    "HiDreamImagePipeline": _image(dit_families.hidream, 5.0, 128),
    "CogVideoXPipeline": _video(video_families.cogvideox, 6.0, 226, 49),
    "HunyuanVideoPipeline": _video(video_families.hunyuan_video, 6.0, 256, 129),
    "WanPipeline": _video(video_families.wan, 5.0, 512, 81),
    "WanImageToVideoPipeline": _video(video_families.wan_image_to_video, 5.0, 512, 81),
    "LTXPipeline": _video(video_families.ltx_video, 3.0, 128, 161),
}
