"""Splits of denoisers whose own forward combines tensors between blocks. SD3's transformer adds the ControlNet's
residuals to its hidden state after each block, in its own forward: with blocks on a second GPU, the hidden state
comes back from GPU 1 and meets a residual on GPU 0, where no input-moving hook of a block reaches (it raised
DeviceMismatchError in aten.add). The split component's forward now runs glued (hooks/parent_glue.py)."""

from __future__ import annotations

import pytest
import torch

from cases import CASES
from pipelines import Pipeline
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from same_output import assert_same_output
from test_e2e_diffusers import run, saved, two_virtual_gpus  # noqa: F401 (fixtures)

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
SD3_CONTROLNET = next(case for case in CASES if case.name == "StableDiffusion3ControlNetPipeline")
SPLIT = {"transformer": {"": 0, "transformer_blocks.1": 1, "transformer_blocks.2": 1, "norm_out": 1, "proj_out": 1},
         "controlnet": 0, "text_encoder": 0, "text_encoder_2": 0, "vae": 0}


def test_sd3_controlnet_transformer_split_over_two_gpus_runs_equal_to_diffusers(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    torch.manual_seed(0)
    SD3_CONTROLNET.build(tmp_path / "parts").save_pretrained(tmp_path / "sd3")
    reference = diffusers.StableDiffusion3ControlNetPipeline.from_pretrained(tmp_path / "sd3", **SD3_CONTROLNET.load)
    pipe = Pipeline.from_pretrained(tmp_path / "sd3", device_map=SPLIT, max_memory={0: "1GiB", 1: "1GiB"},
                                    progress=False, **SD3_CONTROLNET.load)
    assert pipe.hf_device_map["transformer.transformer_blocks.1"] == 1
    assert_same_output(run(pipe, SD3_CONTROLNET), run(reference, SD3_CONTROLNET))


# The classes whose denoiser the planner splits at the budgets below (the others fit whole, or go elsewhere).
# Without the glue, LTX's, AnimateDiff's (and SD3 ControlNet's, above) failed with DeviceMismatchError.
SPLIT_BY_THE_PLANNER = {"PixArtSigmaPipeline", "LTXPipeline", "AnimateDiffPipeline", "FluxKontextPipeline",
                        "FluxImg2ImgPipeline", "Lumina2Pipeline", "FluxInpaintPipeline", "FluxFillPipeline"}


def split_budgets(folder, case) -> dict:
    """Two GPUs, each with room for half of the other components and 60% of the denoiser (plus the largest
    activation and the runtime overhead where the plan charges them): the denoiser cannot stay whole."""
    plan = Pipeline.plan_placement(folder, max_memory={0: "8GiB", 1: "8GiB", "cpu": "8GiB"}, call=case.call,
                                   **case.load)
    denoiser = denoiser_of(plan)
    others = sum(component.bytes for name, component in plan.components.items() if name != denoiser)
    transient = max(component.activation_bytes or 0 for component in plan.components.values())
    overhead = ACCELERATOR_RUNTIME_OVERHEAD if case.call is not None else 0
    budget = overhead + transient + int(0.6 * plan.components[denoiser].bytes) + others // 2 + 1
    return {0: f"{budget}B", 1: f"{budget}B", "cpu": "4GiB"}


def denoiser_of(plan) -> str:
    return next(name for name in ("transformer", "unet") if name in plan.components)


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in CASES])
def test_a_denoiser_the_planner_splits_runs_equal_to_diffusers(saved, case):
    folder = saved(case)
    expected = run(getattr(diffusers, case.name.split(" ")[0]).from_pretrained(folder, **case.load), case)
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory=split_budgets(folder, case),
                                    progress=False, call=case.call, **case.load)
    kind = pipe.placement_plan.components[denoiser_of(pipe.placement_plan)].kind.value
    assert (kind == "split") == (case.name in SPLIT_BY_THE_PLANNER), kind
    assert_same_output(run(pipe, case), expected)
