"""The table: diffusers pipeline class name -> how its call feeds each component, and the call's defaults.

Keyed by the class NAME (model_index.json's `_class_name`), so it serves a folder loaded as a generic pipeline
and one loaded as the diffusers class alike, and needs diffusers only to build the components. Defaults are
the pipeline's own `__call__` defaults (guidance_scale, max_sequence_length, num_frames), so a `call=` that
gives only height and width is planned as diffusers would run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from torch import nn

from . import conditioned_families as conditioned
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
    needs: tuple[str, ...] = ()  # more components the call cannot be described without (a ControlNet)

    @property
    def required(self) -> tuple[str, ...]:
        """The components the latent shapes are read from, and those the call needs besides."""
        return (self.denoiser, "vae", *self.needs)


def _image(describe: Describe, guidance: float, sequence: int | None = None, *, steps: int, step=None) -> Family:
    defaults = {"guidance_scale": guidance, "num_inference_steps": steps,
                **({"max_sequence_length": sequence} if sequence else {})}
    if step is None:
        return Family(describe=describe, pixel_step=dit_families.patch_pixel_step, defaults=defaults)
    return Family(describe=describe, pixel_step=step, defaults=defaults, denoiser="unet")


def _unet(describe: Describe, guidance: float) -> Family:
    return _image(describe, guidance, steps=50, step=unet_families.unet_pixel_step)


def _flux(describe: Describe, guidance: float, *, steps: int = 28) -> Family:
    return Family(describe=describe, pixel_step=dit_families.packed_pixel_step,
                  defaults={"guidance_scale": guidance, "max_sequence_length": 512, "num_inference_steps": steps})


def _controlnet(family: Family) -> Family:
    return replace(family, needs=("controlnet",))


def _video(describe: Describe, guidance: float, sequence: int, frames: int, *, steps: int = 50) -> Family:
    defaults = {"guidance_scale": guidance, "max_sequence_length": sequence, "num_frames": frames,
                "num_inference_steps": steps}
    return Family(describe=describe, pixel_step=video_families.video_pixel_step, defaults=defaults, video=True)


FAMILIES: dict[str, Family] = {  # one row per pipeline class: its call's defaults (diffusers 0.42 `__call__`)
    "StableDiffusionPipeline": _unet(unet_families.stable_diffusion, 7.5),
    "StableDiffusionXLPipeline": _unet(unet_families.stable_diffusion_xl, 5.0),
    "StableDiffusion3Pipeline": _image(dit_families.stable_diffusion_3, 7.0, 256, steps=28),
    "FluxPipeline": _flux(dit_families.flux, 3.5),
    "PixArtSigmaPipeline": _image(dit_families.pixart_sigma, 4.5, 300, steps=20),
    "SanaPipeline": _image(dit_families.sana, 4.5, 300, steps=20),
    "QwenImagePipeline": _image(dit_families.qwen_image, 1.0, 512, steps=50),
    "HiDreamImagePipeline": _image(dit_families.hidream, 5.0, 128, steps=50),
    "AuraFlowPipeline": _image(dit_families.aura_flow, 3.5, 256, steps=50),
    "CogVideoXPipeline": _video(video_families.cogvideox, 6.0, 226, 49),
    "HunyuanVideoPipeline": _video(video_families.hunyuan_video, 6.0, 256, 129),
    "WanPipeline": _video(video_families.wan, 5.0, 512, 81),
    "WanImageToVideoPipeline": _video(video_families.wan_image_to_video, 5.0, 512, 81),
    "LTXPipeline": _video(video_families.ltx_video, 3.0, 128, 161),
    # The variants that take an image or a control image (conditioned_families).
    "StableDiffusionImg2ImgPipeline": _unet(conditioned.sd_with_image, 7.5),
    "StableDiffusionInpaintPipeline": _unet(conditioned.sd_with_image, 7.5),
    "StableDiffusionXLImg2ImgPipeline": _unet(conditioned.sdxl_with_image, 5.0),  # the refiner too
    "StableDiffusionXLInpaintPipeline": _unet(conditioned.sdxl_with_image, 7.5),
    "StableDiffusionControlNetPipeline": _controlnet(_unet(conditioned.sd_controlnet, 7.5)),
    "StableDiffusionControlNetImg2ImgPipeline": _controlnet(_unet(conditioned.sd_controlnet_with_image, 7.5)),
    "StableDiffusionControlNetInpaintPipeline": _controlnet(_unet(conditioned.sd_controlnet_with_image, 7.5)),
    "StableDiffusionXLControlNetPipeline": _controlnet(_unet(conditioned.sdxl_controlnet, 5.0)),
    "StableDiffusionXLControlNetImg2ImgPipeline": _controlnet(_unet(conditioned.sdxl_controlnet_with_image, 5.0)),
    "StableDiffusionXLControlNetInpaintPipeline": _controlnet(_unet(conditioned.sdxl_controlnet_with_image, 5.0)),
    "FluxControlNetPipeline": _controlnet(_flux(conditioned.flux_controlnet, 7.0)),
    "FluxImg2ImgPipeline": _flux(conditioned.flux_with_image, 7.0),
    "FluxInpaintPipeline": _flux(conditioned.flux_with_image, 7.0),
    "FluxFillPipeline": _flux(conditioned.flux_with_image, 30.0, steps=50),
    "FluxKontextPipeline": _flux(conditioned.flux_kontext, 3.5),
    "WanVACEPipeline": _video(conditioned.wan_vace, 5.0, 512, 81),
}
