"""Runs per call, learned by running each pipeline's own __call__ on stand-ins (call capture), equal what diffusers'
real call runs (counted with a hook on a tiny pipeline) and what diffusers' code says: steps times passes (Wan runs
guidance as a second pass, Lumina 2 too; the others batch it), the `strength` share of img2img and inpaint as each
pipeline rounds it, a ControlNet at every step beside its denoiser, true CFG's second pass, and Wan 2.2's two
experts sharing the steps at their boundary timestep."""

from __future__ import annotations

import pytest
import torch

from pipelines.loading.planning import describe_call, modules_and_edges
from recorded_calls import recorded_shapes

import tiny_dits
import tiny_unets
import tiny_videos
from cases import image, mask
from test_e2e_diffusers import two_virtual_gpus  # noqa: F401 (autouse: diffusers' Wan ftfy stand-in)

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
SMALL = {"height": 16, "width": 16}
TEXT = {"max_sequence_length": 8}

CASES = {  # name: (build, call, the denoiser's (and ControlNet's) runs diffusers makes)
    # 50 steps at SDXL img2img's default strength 0.3: int(50 * 0.3)
    "SDXL img2img, default strength": (tiny_unets.sdxl_img2img, {"image": image(16)}, {"unet": 15}),
    # int(10 * 0.75) = 7
    "SD img2img": (tiny_unets.sd_img2img, {"image": image(16), "num_inference_steps": 10, "strength": 0.75},
                   {"unet": 7}),
    # int(2 * 0.9999) = 1
    "SDXL inpaint": (tiny_unets.sdxl_inpaint, {**SMALL, "image": image(16), "mask_image": mask(16),
                                               "num_inference_steps": 2}, {"unet": 1}),
    # FLUX rounds the start down: 28 - int(28 - 28 * 0.6) = 17
    "FLUX img2img, default strength": (tiny_dits.flux_img2img, {**SMALL, **TEXT, "image": image(16)},
                                       {"transformer": 17}),
    "SD ControlNet": (tiny_unets.sd_controlnet, {**SMALL, "image": image(16), "num_inference_steps": 20},
                      {"unet": 20, "controlnet": 20}),
    # guidance as a second pass: 2 x 4
    "Wan image-to-video": (tiny_videos.wan_i2v, {**SMALL, **TEXT, "num_frames": 5, "image": image(16),
                                                 "num_inference_steps": 4}, {"transformer": 8}),
    # no guidance: one pass
    "Wan image-to-video, no guidance": (tiny_videos.wan_i2v, {**SMALL, **TEXT, "num_frames": 5, "image": image(16),
                                                              "num_inference_steps": 4, "guidance_scale": 1.0},
                                        {"transformer": 4}),
    # Wan 2.2: the high-noise expert until t < 875 (shift 3), then the low-noise one; both with guidance passes
    "Wan 2.2, two experts": (tiny_videos.wan22, {**SMALL, **TEXT, "num_frames": 5, "num_inference_steps": 8},
                             {"transformer": 6, "transformer_2": 10}),
    # true CFG: a second pass with the negative prompt
    "Qwen-Image, true CFG": (tiny_dits.qwen_image, {"height": 32, "width": 32, **TEXT, "num_inference_steps": 3,
                                                    "negative_prompt": "blurry", "true_cfg_scale": 4.0},
                             {"transformer": 6}),
    "Qwen-Image, no true CFG": (tiny_dits.qwen_image, {"height": 32, "width": 32, **TEXT, "num_inference_steps": 3},
                                {"transformer": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_runs_per_call_are_those_diffusers_makes(tmp_path, name):
    build, call, expected = CASES[name]
    pipe = build(tmp_path)
    modules, _ = modules_and_edges(pipe)
    captured = describe_call(pipe, modules, call).runs
    real: dict = {}
    recorded_shapes(pipe, {"prompt": "a cat", **call, "generator": torch.Generator().manual_seed(0),
                           "output_type": "pt"}, real)
    assert {key: captured.get(key, 0) for key in expected} == expected
    assert captured == real  # every component, text encoders (negatives) included
