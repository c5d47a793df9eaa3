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
of them (an upper bound: the split depends on the scheduler's timesteps).
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
    guidance_pass: bool = False  # guidance > 1 runs the denoiser a second time per step (not a doubled batch)

    @property
    def required(self) -> tuple[str, str]:
        """The components the latent shapes are read from."""
        return (self.denoiser, "vae")

    def runs(self, spec: CallSpec) -> dict[str, int]:
        """Runs per call of each denoiser (the others run once): steps x passes per step."""
        passes = 2 if self.guidance_pass and spec.guidance_scale > 1.0 else 1
        runs = spec.num_inference_steps * passes
        return {name: runs for name in (self.denoiser, f"{self.denoiser}_2")}


def _image(describe: Describe, guidance: float, sequence: int | None = None, *, steps: int, step=None) -> Family:
    defaults = {"guidance_scale": guidance, "num_inference_steps": steps,
                **({"max_sequence_length": sequence} if sequence else {})}
    if step is None:
        return Family(describe=describe, pixel_step=dit_families.patch_pixel_step, defaults=defaults)
    return Family(describe=describe, pixel_step=step, defaults=defaults, denoiser="unet")


def _video(describe: Describe, guidance: float, sequence: int, frames: int, *, steps: int = 50,
           guidance_pass: bool = False) -> Family:
    defaults = {"guidance_scale": guidance, "max_sequence_length": sequence, "num_frames": frames,
                "num_inference_steps": steps}
    return Family(describe=describe, pixel_step=video_families.video_pixel_step, defaults=defaults, video=True,
                  guidance_pass=guidance_pass)


FAMILIES: dict[str, Family] = {  # one row per family: its call's defaults (diffusers 0.42 `__call__`)
    "StableDiffusionPipeline": _image(unet_families.stable_diffusion, 7.5, steps=50, step=unet_families.unet_pixel_step),
    "StableDiffusionXLPipeline": _image(unet_families.stable_diffusion_xl, 5.0, steps=50,
                                        step=unet_families.unet_pixel_step),
    "StableDiffusion3Pipeline": _image(dit_families.stable_diffusion_3, 7.0, 256, steps=28),
    "FluxPipeline": Family(describe=dit_families.flux, pixel_step=dit_families.packed_pixel_step,
                           defaults={"guidance_scale": 3.5, "max_sequence_length": 512, "num_inference_steps": 28}),
    "PixArtSigmaPipeline": _image(dit_families.pixart_sigma, 4.5, 300, steps=20),
    "SanaPipeline": _image(dit_families.sana, 4.5, 300, steps=20),
    "QwenImagePipeline": _image(dit_families.qwen_image, 1.0, 512, steps=50),
    "HiDreamImagePipeline": _image(dit_families.hidream, 5.0, 128, steps=50),
    "CogVideoXPipeline": _video(video_families.cogvideox, 6.0, 226, 49),
    "HunyuanVideoPipeline": _video(video_families.hunyuan_video, 6.0, 256, 129),
    "WanPipeline": _video(video_families.wan, 5.0, 512, 81, guidance_pass=True),
    "WanImageToVideoPipeline": _video(video_families.wan_image_to_video, 5.0, 512, 81, guidance_pass=True),
    "LTXPipeline": _video(video_families.ltx_video, 3.0, 128, 161),
}
