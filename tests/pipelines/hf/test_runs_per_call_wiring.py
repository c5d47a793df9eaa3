"""Runs per call from `call=` (issue 18): `num_inference_steps` (the pipeline's default when absent) times the
denoiser's passes per step, for our TextToImagePipeline and the known diffusers families; for the variants that
start from an image, the `strength` share of the steps as each pipeline rounds it (issue 19), and the ControlNet
at every step beside the denoiser. tests/pipelines/e2e holds these numbers equal to the runs diffusers makes."""

from __future__ import annotations

import pytest

pipelines = pytest.importorskip("pipelines")

from pipelines.hf.calls import FAMILIES, CallSpec, CallSpecError, family_runs  # noqa: E402


@pytest.mark.parametrize("family, call, runs", [
    ("FluxPipeline", None, 28),  # guidance-distilled: one pass per step, 28 steps by default
    ("StableDiffusion3Pipeline", {}, 28),  # CFG doubles the batch, not the passes
    ("StableDiffusionXLPipeline", {"num_inference_steps": 30}, 30),
    ("HunyuanVideoPipeline", None, 50),
    ("WanPipeline", None, 100),  # guidance runs as a second pass: 2 x 50 steps
    ("WanPipeline", {"num_inference_steps": 28, "guidance_scale": 1.0}, 28),  # no guidance: one pass
    ("WanImageToVideoPipeline", {"num_inference_steps": 28}, 56),
])
def test_family_runs_are_steps_times_passes(family, call, runs):
    found = family_runs(family, call)
    denoiser = FAMILIES[family].denoiser
    assert found[denoiser] == runs


@pytest.mark.parametrize("family, call, runs", [
    ("StableDiffusionXLImg2ImgPipeline", None, {"unet": 15}),  # 50 steps at its default strength 0.3
    ("StableDiffusionXLImg2ImgPipeline", {"num_inference_steps": 30, "strength": 0.5}, {"unet": 15}),
    ("StableDiffusionImg2ImgPipeline", {"num_inference_steps": 10, "strength": 0.75}, {"unet": 7}),  # int(7.5)
    ("StableDiffusionXLInpaintPipeline", {"num_inference_steps": 2}, {"unet": 1}),  # int(2 * 0.9999)
    ("FluxImg2ImgPipeline", None, {"transformer": 17}),  # 28 - int(28 - 16.8): FLUX rounds the start down
    ("FluxFillPipeline", None, {"transformer": 50}),  # strength 1.0: every step
    ("FluxKontextPipeline", {"num_inference_steps": 20}, {"transformer": 20}),
    ("StableDiffusionControlNetPipeline", {"num_inference_steps": 20}, {"unet": 20, "controlnet": 20}),
    ("StableDiffusionXLControlNetImg2ImgPipeline", {"num_inference_steps": 20, "strength": 0.5},
     {"unet": 10, "controlnet": 10}),
    ("FluxControlNetPipeline", None, {"transformer": 28, "controlnet": 28}),
    ("WanVACEPipeline", {"num_inference_steps": 30}, {"transformer": 60}),  # guidance as a second pass
])
def test_variant_runs_follow_steps_strength_and_controlnet(family, call, runs):
    found = family_runs(family, call)
    assert {name: count for name, count in found.items() if name in runs} == runs


@pytest.mark.parametrize("family, call, message", [
    ("FluxKontextPipeline", {"strength": 0.5}, "does not start from an image; leave strength out"),
    ("StableDiffusionPipeline", {"strength": 0.5}, "does not start from an image"),
    ("FluxImg2ImgPipeline", {"strength": 1.5}, r"strength must be a number in \(0, 1\]"),
    ("StableDiffusionImg2ImgPipeline", {"strength": 0}, r"strength must be a number in \(0, 1\]"),
    ("StableDiffusionImg2ImgPipeline", {"num_inference_steps": 2, "strength": 0.4}, "runs no denoising step"),
])
def test_strength_is_checked(family, call, message):
    with pytest.raises(CallSpecError, match=message):
        family_runs(family, call)


def test_every_family_accepts_num_inference_steps_and_checks_it():
    for name, family in FAMILIES.items():
        spec = CallSpec.parse({"height": 64, "width": 64, "num_inference_steps": 9}, pipeline=name,
                              defaults=family.defaults)
        assert spec.num_inference_steps == 9
    with pytest.raises(CallSpecError, match="num_inference_steps must be a positive int"):
        family_runs("FluxPipeline", {"num_inference_steps": 0})
    assert family_runs("NotAPipeline", {"num_inference_steps": 9}) is None


def test_our_pipeline_plans_with_its_denoiser_steps(tmp_path):
    from pipelines import TextToImagePipeline

    folder = tmp_path / "tiny-dit"
    TextToImagePipeline.from_preset("tiny-dit").save_pretrained(folder)
    budgets = {0: "1GiB", "cpu": "1GiB"}
    plan = TextToImagePipeline.plan_placement(folder, max_memory=budgets,
                                              call={"height": 64, "width": 64, "num_inference_steps": 7})
    assert plan.inputs.runs_per_call == {"denoiser": 7} and plan.components["denoiser"].transfer.runs_per_call == 7
    default = TextToImagePipeline.plan_placement(folder, max_memory=budgets)  # __call__'s default: 20 steps
    assert default.components["denoiser"].transfer.runs_per_call == 20
    assert default.components["text_encoder"].transfer.runs_per_call == 1


# Where diffusers' __call__ default is None and the pipeline fills it in from elsewhere.
_FILLED_BY_THE_PIPELINE = {("QwenImagePipeline", "guidance_scale"): 1.0,  # no guidance embedding: unused
                           ("CogVideoXPipeline", "num_frames"): 49}  # from the transformer's config


def test_every_familys_defaults_are_its_pipelines_own():
    import inspect

    diffusers = pytest.importorskip("diffusers")
    for name, family in FAMILIES.items():
        parameters = inspect.signature(getattr(diffusers, name).__call__).parameters
        for key, value in family.defaults.items():
            default = parameters[key].default
            assert (value == default) or _FILLED_BY_THE_PIPELINE.get((name, key)) == value, (name, key, default)
        assert ("strength" in parameters) == (family.strength is not None), name
