"""Splits of denoisers whose own forward combines tensors between blocks. SD3's transformer adds the ControlNet's
residuals to its hidden state after each block, in its own forward: with blocks on a second GPU, the hidden state
comes back from GPU 1 and meets a residual on GPU 0. Input-moving hooks on the blocks cannot reach that addition;
the split is planned all the same. Known gap (issue 26), held here until splits follow the parent's dataflow."""

from __future__ import annotations

import pytest
import torch

from cases import CASES
from pipelines import Pipeline
from same_output import assert_same_output
from test_e2e_diffusers import run

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
SD3_CONTROLNET = next(case for case in CASES if case.name == "StableDiffusion3ControlNetPipeline")
SPLIT = {"transformer": {"": 0, "transformer_blocks.1": 1, "transformer_blocks.2": 1, "norm_out": 1, "proj_out": 1},
         "controlnet": 0, "text_encoder": 0, "text_encoder_2": 0, "vae": 0}


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="the parent's residual addition mixes GPU 0 and GPU 1 (DeviceMismatchError in aten.add)")
def test_sd3_controlnet_transformer_split_over_two_gpus_runs_equal_to_diffusers(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    torch.manual_seed(0)
    SD3_CONTROLNET.build(tmp_path / "parts").save_pretrained(tmp_path / "sd3")
    reference = diffusers.StableDiffusion3ControlNetPipeline.from_pretrained(tmp_path / "sd3", **SD3_CONTROLNET.load)
    pipe = Pipeline.from_pretrained(tmp_path / "sd3", device_map=SPLIT, max_memory={0: "1GiB", 1: "1GiB"},
                                    progress=False, **SD3_CONTROLNET.load)
    assert pipe.hf_device_map["transformer.transformer_blocks.1"] == 1
    assert_same_output(run(pipe, SD3_CONTROLNET), run(reference, SD3_CONTROLNET))
