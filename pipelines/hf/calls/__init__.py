"""Call-aware example inputs for the real diffusers pipeline families, by pipeline class name.

`family_calls(class_name, modules, call)` gives, per module component, the meta-tensor calls one
`pipe(prompt, height=..., width=..., ...)` makes of it; `pipelines.loading.planning.call_activations` uses
it for pipelines that do not describe their inputs themselves (no `activation_inputs` method).
`family_runs(class_name, call)` gives how many times each denoiser (and ControlNet) runs per call (steps x
passes per step; the `strength` share of the steps for a call that starts from an image).

spec.py            CallSpec (the call's sizes, the family's defaults), ExampleCall (one method call on meta)
shapes.py          meta tensors and the facts read from component configs (VAE factors, latent frames)
text_encoders.py   CLIP / T5 / UMT5 / LLM (Llama, Gemma2, Qwen2.5-VL) encoder calls, CLIP vision
unet_families.py   Stable Diffusion 1.x/2.x, SDXL
dit_families.py    SD3/3.5, FLUX.1, PixArt-Sigma, Sana, Qwen-Image, HiDream-I1, AuraFlow
video_families.py  CogVideoX, HunyuanVideo, Wan 2.1 T2V/I2V, LTX-Video
conditioned_families.py  the variants that take an image: img2img, inpaint, the SDXL refiner, ControlNet (SD,
                   SDXL, FLUX.1), FLUX.1 Img2Img/Inpaint/Fill/Kontext, Wan VACE
family_table.py    the table: class name -> Family (how it calls its components, its call defaults)
vae_techniques.py  VAE tiling/slicing: which VAEs offer them, and a VAE call estimated with them on
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .capture import CallCaptureError, CapturedCall, capture_call
from .family_table import FAMILIES
from .spec import CALL_KEYS, CallSpec, CallSpecError, ExampleCall


class UnknownPipelineCallError(CallSpecError):
    """A pipeline class whose call's inputs this library does not know."""


def family_calls(class_name: str, modules: Mapping[str, nn.Module],
                 call: Mapping[str, Any]) -> dict[str, tuple[ExampleCall, ...]]:
    """Per module component of a `class_name` pipeline, the example calls `call` makes of it (on meta)."""
    family = FAMILIES.get(class_name)
    if family is None:
        raise UnknownPipelineCallError(
            f"call= is not known for {class_name}: this library describes the inputs of "
            f"{', '.join(sorted(FAMILIES))}. For another pipeline, give its class an `activation_inputs(self, "
            "**call)` method returning {component: ExampleCall(args=..., kwargs=..., method=...)} with meta "
            "tensors of the shapes its __call__ passes (see pipelines/hf/calls/), or plan without call= "
            "(weights only)."
        )
    spec = family.parse(call, pipeline=class_name)
    if not family.video and spec.num_frames not in (None, 1):
        raise CallSpecError(f"call= for {class_name}: num_frames={spec.num_frames}, but it makes images; leave "
                            "num_frames out.")
    missing = [name for name in family.required if not isinstance(modules.get(name), nn.Module)]
    if missing:
        raise CallSpecError(f"call= for {class_name} needs component(s) {missing} to size its latents; the "
                            f"pipeline has {sorted(modules)}.")
    spec.checked_multiple(family.pixel_step(modules), pipeline=class_name)
    return family.describe(modules, spec)


def family_runs(class_name: str, call: Mapping[str, Any] | None) -> dict[str, int] | None:
    """Runs per call of each denoiser and ControlNet of a `class_name` pipeline (its steps, twice where guidance
    is a second pass) for `call`, the family's defaults filling what it leaves out; None for a family this library does
    not know."""
    family = FAMILIES.get(class_name)
    if family is None:
        return None
    sizes = {"height": 1, "width": 1}  # runs do not depend on the sizes; the call's own are checked if given
    spec = family.parse({**sizes, **dict(call or {})}, pipeline=class_name)
    return family.runs(spec, pipeline=class_name)


__all__ = ["CALL_KEYS", "CallCaptureError", "CapturedCall", "capture_call", "CallSpec", "CallSpecError", "ExampleCall", "FAMILIES", "UnknownPipelineCallError",
           "family_calls", "family_runs"]
