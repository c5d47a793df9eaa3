"""VAE tiling and slicing planned as memory techniques, on a tiny Stable Diffusion folder saved by diffusers whose
VAE decode (64x64, 32 channels) is the largest activation: when the decode does not fit, the plan turns tiling on
(slicing first for a batch), says why in the verdict and explain(), keeps it in its JSON, and the load applies
it, so the images equal diffusers' own with `vae.enable_tiling()`; `call=` forces or forbids each technique; and a
call that fits nowhere even tiled is an error naming the activation, with what would fit."""

from __future__ import annotations

import pytest
import torch

from pipelines import Pipeline
from pipelines.errors import CallSpecError
from placement import Plan
from placement.errors import DoesNotFitError
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD as OVERHEAD
from placement.plan_schema import MemoryTechnique, PlacementKind

from tiny_parts import clip_config, clip_tokenizer, sd_unet, seeded
from same_output import assert_same_output

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
CALL = {"height": 64, "width": 64}


@pytest.fixture(autouse=True)
def two_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiling")
    vae = seeded(lambda: diffusers.AutoencoderKL(sample_size=16, block_out_channels=(32,), layers_per_block=1,
                                                 latent_channels=4, norm_num_groups=1))  # 16-pixel tiles
    diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())),
        tokenizer=clip_tokenizer(root / "vocab"), unet=seeded(sd_unet),
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False).save_pretrained(root / "sd")
    return root / "sd"


@pytest.fixture(scope="module")
def sizes(folder):
    """Weights and activation peaks (untiled, tiled, sliced for a batch of 2) of the folder's components."""
    roomy = {0: "8GiB", 1: "8GiB", "cpu": "8GiB"}

    def plan(**call):
        return Pipeline.plan_placement(folder, max_memory=roomy, call={**CALL, **call}).components

    plain, tiled = plan(), plan(vae_tiling=True)
    batch, sliced = plan(num_images_per_prompt=2), plan(num_images_per_prompt=2, vae_slicing=True)
    return {"weights": sum(c.bytes for c in plain.values()), "vae_weights": plain["vae"].bytes,
            "unet": plain["unet"].activation_bytes, "vae": plain["vae"].activation_bytes,
            "tiled": tiled["vae"].activation_bytes, "batch_unet": batch["unet"].activation_bytes,
            "batch_vae": batch["vae"].activation_bytes, "sliced": sliced["vae"].activation_bytes}


def one_gpu(weights: int, room: int) -> dict:
    """GPU 0 holds every weight and `room` for the largest activation; GPU 1 nothing; the CPU plenty."""
    return {0: f"{OVERHEAD + weights + room}B", 1: 0, "cpu": "4GiB"}


def test_the_numbers_this_file_relies_on(sizes):
    assert sizes["tiled"] < sizes["unet"] < sizes["vae"]  # the decode is the largest, and tiling shrinks it
    assert sizes["batch_unet"] < sizes["sliced"] < sizes["batch_vae"]


def test_a_decode_that_does_not_fit_is_planned_tiled_and_says_why(folder, sizes, tmp_path):
    budget = one_gpu(sizes["weights"], (sizes["unet"] + sizes["vae"]) // 2)
    untiled = Pipeline.plan_placement(folder, max_memory=budget, call={**CALL, "vae_tiling": False})
    assert untiled.components["vae"].execution_device == "cpu" and not untiled.components["vae"].memory_techniques
    plan = Pipeline.plan_placement(folder, max_memory=budget, call=CALL)
    vae = plan.components["vae"]
    assert vae.kind is PlacementKind.WHOLE and vae.execution_device == 0
    assert [used.technique for used in vae.memory_techniques] == [MemoryTechnique.VAE_TILING]
    assert vae.activation_bytes == sizes["tiled"] and vae.memory_techniques[0].activation_bytes_without == sizes["vae"]
    reason = vae.memory_techniques[0].reason
    assert "decoded whole" in reason and "tiles of 16x16 pixels" in reason and "vae on the CPU" in reason
    assert any(w.startswith("vae: VAE tiling on") for w in plan.verdict.warnings)
    assert "VAE tiling on (the load turns it on)" in plan.explain()
    assert Plan.from_json(plan.to_json()) == plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert Pipeline.plan_placement(folder, device_map=str(tmp_path / "plan.json")) == plan


def test_the_load_applies_the_tiling_and_generates_what_diffusers_does_tiled(folder, sizes):
    budget = one_gpu(sizes["weights"], (sizes["unet"] + sizes["vae"]) // 2)
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory=budget, call=CALL, progress=False)
    assert pipe.vae.use_tiling and not pipe.vae.use_slicing
    reference = diffusers.StableDiffusionPipeline.from_pretrained(folder)
    reference.vae.enable_tiling()
    assert_same_output(generate(pipe), generate(reference))
    pipe.reset_device_map()  # the VAE as it was: the tiling the load turned on is off again
    assert not pipe.vae.use_tiling


def generate(pipe, **call):
    with torch.no_grad():
        return pipe("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="pt",
                    **CALL, **call).images.cpu()


def test_a_batch_is_sliced_first(folder, sizes):
    budget = one_gpu(sizes["weights"], (sizes["sliced"] + sizes["batch_vae"]) // 2)
    plan = Pipeline.plan_placement(folder, max_memory=budget, call={**CALL, "num_images_per_prompt": 2})
    vae = plan.components["vae"]
    assert [used.technique for used in vae.memory_techniques] == [MemoryTechnique.VAE_SLICING]
    assert vae.activation_bytes == sizes["sliced"] and vae.execution_device == 0


def test_call_forces_a_technique_where_nothing_needs_it(folder):
    plan = Pipeline.plan_placement(folder, max_memory={0: "8GiB", 1: "8GiB"}, call={**CALL, "vae_tiling": True})
    (used,) = plan.components["vae"].memory_techniques
    assert used.technique is MemoryTechnique.VAE_TILING and used.reason.startswith("asked for in call=")
    assert not Pipeline.plan_placement(folder, max_memory={0: "8GiB", 1: "8GiB"},
                                       call=CALL).components["vae"].memory_techniques


def test_a_decode_that_fits_nowhere_names_the_activation_and_what_would_fit(folder, sizes):
    # GPU 0 holds the text encoder and UNet and the UNet's activations, not a byte more (so no part of the VAE
    # stays there across phases); GPU 1 holds the VAE's weights but not its tiled activations at 64x64 (3/4 of
    # them: enough at 32x32); the CPU nothing (nothing is loaded per call from it).
    others = sizes["weights"] - sizes["vae_weights"]
    budget = {0: f"{OVERHEAD + others + sizes['unet']}B",
              1: f"{OVERHEAD + sizes['vae_weights'] + sizes['tiled'] * 3 // 4}B", "cpu": 0}
    with pytest.raises(DoesNotFitError) as caught:
        Pipeline.plan_placement(folder, max_memory=budget, call=CALL)
    message = str(caught.value)
    assert message.startswith("The VAE's activations do not fit, not its weights: vae has")
    assert "decoded whole" in message and "tiled (tiles of 16x16 pixels)" in message
    assert "What would fit: a smaller call, height=32, width=32 (activations then vae" in message
    assert "or an accelerator with 1.00 GiB for vae alone" in message


@pytest.mark.parametrize("call, message", [
    ({**CALL, "vae_tiling": "yes"}, "vae_tiling must be True, False or None"),
])
def test_technique_options_are_checked(folder, call, message):
    with pytest.raises(CallSpecError, match=message):
        Pipeline.plan_placement(folder, max_memory={0: "8GiB"}, call=call)


def test_our_pipelines_vae_is_tiled_the_same_way(tmp_path):
    from pipelines import TextToImagePipeline

    folder, built = tmp_path / "ours", TextToImagePipeline.from_preset("tiny-unet", seed=0)
    built.save_pretrained(folder)  # the own reference UNet pipeline (release 0.1), until it is retired
    call = {"height": 64, "width": 64, "guidance_scale": 1.0}  # no CFG: the decode is the largest activation
    roomy = TextToImagePipeline.plan_placement(folder, max_memory={0: "8GiB", 1: "8GiB"}, call=call).components
    denoiser, untiled = roomy["denoiser"].activation_bytes, roomy["vae"].activation_bytes
    assert denoiser < untiled
    budget = one_gpu(sum(c.bytes for c in roomy.values()), (denoiser + untiled) // 2)
    pipe = TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory=budget, call=call,
                                               progress=False)
    planned = pipe.placement_plan.components["vae"]
    assert planned.execution_device == 0 and planned.activation_bytes < denoiser
    assert [used.technique for used in planned.memory_techniques] == [MemoryTechnique.VAE_TILING]
    assert pipe.vae.use_tiling
    built.enable_vae_tiling()

    def images(of):
        return of("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="pt",
                  **call).images.cpu()

    assert_same_output(images(pipe), images(built))


def test_a_vae_given_with_tiling_on_is_planned_tiled(folder):
    import pipelines

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(folder)
    pipe.vae.enable_tiling()
    plan = pipelines.place(pipe, max_memory={0: "8GiB", 1: "8GiB"}, call=CALL)
    (used,) = plan.components["vae"].memory_techniques
    assert used.technique is MemoryTechnique.VAE_TILING and used.reason.startswith("on already")
    assert pipe.vae.use_tiling
    pipe.reset_device_map()
    assert pipe.vae.use_tiling  # the user's own setting stays
