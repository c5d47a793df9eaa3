"""Runs per call from `call=` (issue 18): `num_inference_steps` (the pipeline's default when absent) times the
denoiser's passes per step, for our TextToImagePipeline and the known diffusers families."""

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
