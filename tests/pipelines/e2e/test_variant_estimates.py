"""call= for the variants that take an image: the activation estimate of every denoiser, ControlNet and VAE call
(on meta, from the call description) is within 10% of torch's MemTracker on a real CPU run of the same call at
64x64 (the shapes are held to the pipeline's own in test_e2e_diffusers); and what call= accepts and refuses."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from torch.utils._pytree import tree_map_with_path

from pipelines.hf.calls import CallSpecError, family_calls
from pipelines.loading.planning import modules_and_edges
from placement.activations.measure import measure_activations

import tiny_dits
import tiny_unets

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
SIZE = {"height": 64, "width": 64}
VARIANTS = {
    "StableDiffusionControlNetPipeline": (tiny_unets.sd_controlnet, SIZE),
    "StableDiffusionXLControlNetPipeline": (tiny_unets.sdxl_controlnet, SIZE),
    "StableDiffusionInpaintPipeline": (tiny_unets.sd_inpaint, SIZE),
    "FluxControlNetPipeline": (tiny_dits.flux_controlnet, {**SIZE, "max_sequence_length": 8}),
    "FluxKontextPipeline": (tiny_dits.flux_kontext, {**SIZE, "max_sequence_length": 8}),
    "FluxFillPipeline": (tiny_dits.flux_fill, {**SIZE, "max_sequence_length": 8}),
}


def real(example):
    """Real tensors of the example call's shapes (noise; ones for ids and masks)."""
    def make(_, value):
        if not isinstance(value, torch.Tensor):
            return value
        return torch.randn(value.shape, dtype=value.dtype) if value.is_floating_point() else \
            torch.ones(value.shape, dtype=value.dtype)

    return tree_map_with_path(make, (example.args, dict(example.kwargs)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_estimates_are_within_ten_percent_of_a_real_run(tmp_path, name):
    build, call = VARIANTS[name]
    pipe = build(tmp_path)
    modules, _ = modules_and_edges(pipe)
    for component, examples in family_calls(name, modules, call).items():
        if component not in ("unet", "transformer", "controlnet", "vae"):
            continue
        for example in examples:
            estimate = example.estimate(modules[component])
            args, kwargs = real(example)
            measured = measure_activations(modules[component].eval(), args, kwargs, method=example.method)
            assert abs(estimate - measured) <= 0.10 * measured, (component, example.method, estimate, measured)


def test_a_multi_controlnet_is_refused_with_what_to_do(tmp_path):
    pipe = tiny_unets.sd_controlnet(tmp_path)
    modules, _ = modules_and_edges(pipe)
    with init_empty_weights():
        modules["controlnet"] = diffusers.MultiControlNetModel([pipe.controlnet, pipe.controlnet])
    with pytest.raises(CallSpecError, match="one ControlNet.*MultiControlNetModel.*activations="):
        family_calls("StableDiffusionControlNetPipeline", modules, SIZE)


def test_num_inference_steps_is_accepted_and_a_missing_controlnet_named(tmp_path):
    pipe = tiny_unets.sd_controlnet(tmp_path)
    modules, _ = modules_and_edges(pipe)
    assert "controlnet" in family_calls("StableDiffusionControlNetPipeline", modules,
                                        {**SIZE, "num_inference_steps": 4})
    with pytest.raises(CallSpecError, match=r"num_inference_steps must be a positive int"):
        family_calls("StableDiffusionControlNetPipeline", modules, {**SIZE, "num_inference_steps": 0})
    del modules["controlnet"]
    with pytest.raises(CallSpecError, match=r"needs component\(s\) \['controlnet'\]"):
        family_calls("StableDiffusionControlNetPipeline", modules, SIZE)


def test_our_pipelines_take_num_inference_steps_in_call_too():
    from pipelines import TextToImagePipeline
    from pipelines.loading.planning import call_activations

    pipe = TextToImagePipeline.from_preset("tiny-unet", device="meta")
    modules, _ = modules_and_edges(pipe)
    assert call_activations(pipe, modules, {**SIZE, "num_inference_steps": 4}) == call_activations(pipe, modules, SIZE)
