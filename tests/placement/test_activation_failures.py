"""A failed activation estimate reports itself in one line, and torch says nothing: fake-tensor execution logs
every meta kernel that raises (a 30-odd line traceback through torch's own handler) before the exception
reaches us, which buried our one-line error on the command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelines import TextToImagePipeline
from pipelines.text_to_image.models.autoencoder_kl import AutoencoderKL
from placement.activations.estimate import ActivationEstimateError, estimate_activations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
from pipeline_fixtures import save_preset  # noqa: E402


class WrongWidth(nn.Module):
    """Fed an input of the wrong width: the meta kernel of `mm` raises inside the fake run (torch logs that)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class DecodeWithWrongShapes(AutoencoderKL):
    """A VAE whose decode multiplies shapes that do not fit: the meta kernel raises, and torch would log it."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        latents.flatten(1) @ torch.zeros(3, 3, device=latents.device)
        return super().decode(latents)


def torch_records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name.startswith("torch")]


def test_a_meta_kernel_failure_reaches_the_user_as_one_line_and_torch_logs_nothing(capfd, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ActivationEstimateError) as raised:
        estimate_activations(WrongWidth(), (torch.empty(2, 5, device="meta"),))
    message = str(raised.value)
    assert "\n" not in message and "WrongWidth.forward" in message and "float32[2, 5]" in message
    assert "a and b must have same reduction dim" in message  # torch's reason, first line only
    assert isinstance(raised.value.__cause__, RuntimeError)  # the whole error stays available to debug
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert torch_records(caplog) == []


def test_the_loggers_and_warnings_come_back_after_the_estimate(caplog):
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    with pytest.raises(ActivationEstimateError):
        estimate_activations(WrongWidth(), (torch.empty(2, 5, device="meta"),))
    assert not fake_tensor_log.disabled and not logging.getLogger("torch").disabled
    estimate_activations(WrongWidth(), (torch.empty(2, 4, device="meta"),))  # a good call still estimates
    assert not fake_tensor_log.disabled


def test_a_pipeline_plan_names_the_component_and_what_to_pass_instead(tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    folder, pipe = save_preset(tmp_path / "tiny-dit")
    broken = DecodeWithWrongShapes(pipe.vae.config)
    with pytest.raises(ActivationEstimateError) as raised:
        TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"}, call={"height": 64, "width": 64},
                                           vae=broken)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("Could not estimate the activations of component 'vae' (DecodeWithWrongShapes.decode")
    assert "plan without call=" in message and "activations={'vae': <bytes>" in message
    _, err = capfd.readouterr()
    assert "fake_tensor" not in err and "Traceback" not in err
    assert torch_records(caplog) == []
    # What the message offers works: without call= the same components plan (weights only).
    plan = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"}, vae=broken)
    assert "vae" in plan.components
