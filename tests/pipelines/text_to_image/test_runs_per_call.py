"""Runs per call for our own pipeline: `num_inference_steps` (its `__call__` default when absent) is how many times
its denoiser runs (`runs_per_call`); the others run once. Diffusers pipelines' runs are learned by running their own
__call__ (tests/pipelines/e2e/test_diffusers_runs_per_call.py)."""

from __future__ import annotations


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
