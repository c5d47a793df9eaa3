"""A diffusers pipeline whose denoiser branches on data (`if torch.all(x == 0):`, as HunyuanVideo 1.5's
transformer does) is planned with `call=`: its `__call__` is captured through the fallback's guessed-value run, the
denoiser is planned on its weights with a warning naming it, and every other component's activations are counted."""

from __future__ import annotations

import pytest
import torch

from pipelines import Pipeline

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from test_diffusers_pipelines import build_sd  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class UNetThatBranchesOnData(diffusers.UNet2DConditionModel):
    def forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        if torch.all(encoder_hidden_states == 0):  # a value read: fake tensors have none
            encoder_hidden_states = encoder_hidden_states + 1
        return super().forward(sample, timestep, encoder_hidden_states, *args, **kwargs)


def test_a_denoiser_branching_on_data_is_planned_on_its_weights_and_the_call_still_is(tmp_path):
    build_sd(tmp_path).save_pretrained(tmp_path / "sd")
    plain = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "sd" / "unet")
    unet = UNetThatBranchesOnData.from_config(plain.config)
    call = {"height": 64, "width": 64, "num_inference_steps": 3}
    with pytest.warns(UserWarning, match=r"The plan counts unet's weights only, not its activations: its call "
                                         r"UNetThatBranchesOnData.forward .* reads tensor values"):
        plan = Pipeline.plan_placement(tmp_path / "sd", max_memory={0: "2GiB", "cpu": "4GiB"}, call=call, unet=unet)
    components = plan.components
    assert components["unet"].activation_bytes == 0 and components["unet"].activations_not_counted
    assert plan.inputs.runs_per_call["unet"] == 3  # the capture went on past the fallback: its runs are known
    assert components["vae"].activation_bytes > 0 and components["vae"].activations_not_counted is None
    assert components["text_encoder"].activation_bytes > 0
    assert any(note.startswith("unet: activations NOT counted") for note in plan.verdict.warnings)
    # The same pipeline with diffusers' own UNet is estimated whole: the fallback is only where the estimate fails.
    counted = Pipeline.plan_placement(tmp_path / "sd", max_memory={0: "2GiB", "cpu": "4GiB"}, call=call, unet=plain)
    assert counted.components["unet"].activation_bytes > 0 and counted.components["unet"].activations_not_counted is None
