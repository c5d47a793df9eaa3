"""The table: diffusers pipeline class name -> how its call feeds each component, and the call's defaults.

Keyed by the class NAME (model_index.json's `_class_name`), so it serves a folder loaded as a generic pipeline
and one loaded as the diffusers class alike, and needs diffusers only to build the components. Defaults are
the pipeline's own `__call__` defaults (guidance_scale, max_sequence_length, num_frames, num_inference_steps),
so a `call=` that gives only height and width is planned as diffusers would run it.

Runs per call (`Family.runs`): the denoiser runs once per step, twice where the pipeline runs guidance as a
second pass instead of a doubled batch (diffusers 0.42): Wan 2.1/2.2 T2V and I2V (`noise_uncond =
current_model(...)` when guidance_scale > 1). The others batch the negatives (SD 1.x/2.x, SDXL, SD3, PixArt,
Sana, HiDream, CogVideoX, LTX) or are guidance-distilled (FLUX.1-dev, HunyuanVideo: one pass); FLUX, Qwen-Image
and HunyuanVideo add a second pass only for true CFG (`true_cfg_scale > 1` with a negative prompt), which
`call=` does not describe: planned as one pass. Wan 2.2's two experts share the steps; each is counted at all
of them (an upper bound: the split depends on the scheduler's timesteps). A ControlNet runs with the denoiser at
every step (once per step: on the doubled batch where the negatives are batched). The variants that start from an
image (img2img, inpaint, Fill, their ControlNets) run only the last `strength` share of the steps, rounded as each
pipeline's `get_timesteps` rounds it (`StrengthSteps`); `strength` defaults to the pipeline's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Mapping

from torch import nn

from . import conditioned_families as conditioned
from . import dit_families, unet_families, video_families
from .spec import CallSpec, CallSpecError, ExampleCall

Describe = Callable[[Mapping[str, nn.Module], CallSpec], dict[str, tuple[ExampleCall, ...]]]


class StrengthSteps(Enum):
    """How a pipeline that starts from an image turns `strength` into the steps it runs (its `get_timesteps`)."""

    INIT_TRUNCATED = "int(steps * strength)"  # SD 1.x/2.x, SDXL and their ControlNets
    START_TRUNCATED = "steps - int(steps - steps * strength)"  # FLUX.1 Img2Img, Inpaint, Fill

    def steps(self, steps: int, strength: float) -> int:
        """The denoising steps run: diffusers' own arithmetic, float rounding included."""
        if self is StrengthSteps.INIT_TRUNCATED:
            return steps - max(steps - min(int(steps * strength), steps), 0)
        return steps - int(max(steps - min(steps * strength, steps), 0))


@dataclass(frozen=True, kw_only=True)
class Family:
    """How one pipeline class calls its components: `describe`, the pixel step of its latent grid, defaults."""

    describe: Describe
    pixel_step: Callable[[Mapping[str, nn.Module]], int]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    video: bool = False
    denoiser: str = "transformer"
    guidance_pass: bool = False  # guidance > 1 runs the denoiser a second time per step (not a doubled batch)
    needs: tuple[str, ...] = ()  # more components the call cannot be described without (a ControlNet)
    strength: StrengthSteps | None = None  # starts from an image: runs the last `strength` share of the steps

    @property
    def required(self) -> tuple[str, ...]:
        """The components the latent shapes are read from, and those the call needs besides."""
        return (self.denoiser, "vae", *self.needs)

    def parse(self, call: Mapping[str, Any], *, pipeline: str) -> CallSpec:
        """`call` with this family's defaults; `strength` only where the pipeline takes one."""
        if self.strength is None and call.get("strength") is not None:
            raise CallSpecError(f"call= for {pipeline}: strength={call['strength']!r}, but {pipeline} does not "
                                "start from an image; leave strength out.")
        return CallSpec.parse(call, pipeline=pipeline, defaults=self.defaults)

    def denoising_steps(self, spec: CallSpec, *, pipeline: str) -> int:
        """The steps the denoiser runs: all of them, or the `strength` share of an image-to-image call."""
        if self.strength is None or spec.strength is None:
            return spec.num_inference_steps
        steps = self.strength.steps(spec.num_inference_steps, spec.strength)
        if steps < 1:
            raise CallSpecError(f"call= for {pipeline}: num_inference_steps={spec.num_inference_steps} at "
                                f"strength={spec.strength} runs no denoising step ({self.strength.value} = 0); "
                                "diffusers refuses it. Give more steps or a larger strength.")
        return steps

    def runs(self, spec: CallSpec, *, pipeline: str) -> dict[str, int]:
        """Runs per call of each denoiser and ControlNet (the others run once): steps x passes per step."""
        passes = 2 if self.guidance_pass and spec.guidance_scale > 1.0 else 1
        runs = self.denoising_steps(spec, pipeline=pipeline) * passes
        return {name: runs for name in (self.denoiser, f"{self.denoiser}_2", *self.needs)}


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


def _from_image(family: Family, strength: float) -> Family:
    """`family` starting from an image at the pipeline's default `strength` (SD-style or FLUX-style rounding)."""
    rounding = StrengthSteps.INIT_TRUNCATED if family.denoiser == "unet" else StrengthSteps.START_TRUNCATED
    return replace(family, strength=rounding, defaults={**family.defaults, "strength": strength})


def _video(describe: Describe, guidance: float, sequence: int, frames: int, *, steps: int = 50,
           guidance_pass: bool = False) -> Family:
    defaults = {"guidance_scale": guidance, "max_sequence_length": sequence, "num_frames": frames,
                "num_inference_steps": steps}
    return Family(describe=describe, pixel_step=video_families.video_pixel_step, defaults=defaults, video=True,
                  guidance_pass=guidance_pass)


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
    "WanPipeline": _video(video_families.wan, 5.0, 512, 81, guidance_pass=True),
    "WanImageToVideoPipeline": _video(video_families.wan_image_to_video, 5.0, 512, 81, guidance_pass=True),
    "LTXPipeline": _video(video_families.ltx_video, 3.0, 128, 161),
    # The variants that take an image or a control image (conditioned_families), with their default strength.
    "StableDiffusionImg2ImgPipeline": _from_image(_unet(conditioned.sd_with_image, 7.5), 0.8),
    "StableDiffusionInpaintPipeline": _from_image(_unet(conditioned.sd_with_image, 7.5), 1.0),
    "StableDiffusionXLImg2ImgPipeline": _from_image(_unet(conditioned.sdxl_with_image, 5.0), 0.3),  # the refiner too
    "StableDiffusionXLInpaintPipeline": _from_image(_unet(conditioned.sdxl_with_image, 7.5), 0.9999),
    "StableDiffusionControlNetPipeline": _controlnet(_unet(conditioned.sd_controlnet, 7.5)),
    "StableDiffusionControlNetImg2ImgPipeline": _from_image(
        _controlnet(_unet(conditioned.sd_controlnet_with_image, 7.5)), 0.8),
    "StableDiffusionControlNetInpaintPipeline": _from_image(
        _controlnet(_unet(conditioned.sd_controlnet_with_image, 7.5)), 1.0),
    "StableDiffusionXLControlNetPipeline": _controlnet(_unet(conditioned.sdxl_controlnet, 5.0)),
    "StableDiffusionXLControlNetImg2ImgPipeline": _from_image(
        _controlnet(_unet(conditioned.sdxl_controlnet_with_image, 5.0)), 0.8),
    "StableDiffusionXLControlNetInpaintPipeline": _from_image(
        _controlnet(_unet(conditioned.sdxl_controlnet_with_image, 5.0)), 0.9999),
    "FluxControlNetPipeline": _controlnet(_flux(conditioned.flux_controlnet, 7.0)),
    "FluxImg2ImgPipeline": _from_image(_flux(conditioned.flux_with_image, 7.0), 0.6),
    "FluxInpaintPipeline": _from_image(_flux(conditioned.flux_with_image, 7.0), 0.6),
    "FluxFillPipeline": _from_image(_flux(conditioned.flux_with_image, 30.0, steps=50), 1.0),
    "FluxKontextPipeline": _flux(conditioned.flux_kontext, 3.5),
    "WanVACEPipeline": _video(conditioned.wan_vace, 5.0, 512, 81, guidance_pass=True),
}
