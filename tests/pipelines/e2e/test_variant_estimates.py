"""call= for the variants that take an image: the activation estimate of every denoiser, ControlNet and VAE call
(captured from the pipeline's own __call__, on meta) is within 10% of torch's MemTracker on a real CPU run of the
same call at 64x64 (the shapes are held to the pipeline's own in test_e2e_diffusers); and what call= accepts and
refuses."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch.utils._pytree import tree_map_with_path

from pipelines.errors import CallSpecError
from pipelines.loading.planning import describe_call, modules_and_edges
from placement.activations.estimate import measure_activations

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
    # Kontext would resize its image to a preferred resolution and the call up to max_area (1024x1024): kept at 64;
    # its image is optional (without it, text-to-image): given, for the edit's estimates
    "FluxKontextPipeline": (tiny_dits.flux_kontext, {**SIZE, "max_sequence_length": 8, "_auto_resize": False,
                                                     "max_area": 64 * 64, "image": (64, 64)}),
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
    for component, examples in describe_call(pipe, modules, {**call, "num_inference_steps": 1}).calls.items():
        if component not in ("unet", "transformer", "controlnet", "vae"):
            continue
        for example in examples:
            estimate = example.estimate(modules[component])
            args, kwargs = real(example)
            measured = measure_activations(modules[component].eval(), args, kwargs, method=example.method)
            assert abs(estimate - measured) <= 0.10 * measured, (component, example.method, estimate, measured)


def test_a_multi_controlnet_is_planned_as_the_pipeline_runs_it(tmp_path):
    """Two ControlNets in one MultiControlNetModel (the table refused it): capture runs the pipeline's own loop,
    which calls the multi model once per step with both control images; its peak is at least one ControlNet's."""
    pipe = tiny_unets.sd_controlnet(tmp_path)
    modules, _ = modules_and_edges(pipe)
    single = describe_call(pipe, modules, {**SIZE, "num_inference_steps": 2})
    pipe.controlnet = diffusers.MultiControlNetModel([pipe.controlnet, pipe.controlnet])
    modules, _ = modules_and_edges(pipe)
    control = Image.new("RGB", (64, 64))
    multi = describe_call(pipe, modules, {**SIZE, "num_inference_steps": 2, "image": [control, control]})
    assert multi.runs["controlnet"] == single.runs["controlnet"] == 2
    assert multi.peaks["controlnet"] >= single.peaks["controlnet"]


def test_num_inference_steps_is_accepted_and_a_call_the_pipeline_refuses_is_named(tmp_path):
    pipe = tiny_unets.sd_controlnet(tmp_path)
    modules, _ = modules_and_edges(pipe)
    assert describe_call(pipe, modules, {**SIZE, "num_inference_steps": 4}).runs["controlnet"] == 4
    refused = {**SIZE, "control_guidance_start": 0.8, "control_guidance_end": 0.2}  # diffusers' check_inputs says no
    with pytest.raises(CallSpecError,
                       match=r"StableDiffusionControlNetPipeline.__call__ refuses this call.*cannot be larger or equal"):
        describe_call(pipe, modules, refused)


def test_our_pipelines_take_num_inference_steps_in_call_too():
    from pipelines import TextToImagePipeline
    from pipelines.loading.planning import call_activations

    pipe = TextToImagePipeline.from_preset("tiny-unet", device="meta")
    modules, _ = modules_and_edges(pipe)
    assert call_activations(pipe, modules, {**SIZE, "num_inference_steps": 4}) == call_activations(pipe, modules, SIZE)
