"""fp8 layerwise casting as a plan option: planned at the stored bytes with diffusers' skip patterns, applied at
load (weights read straight into fp8), equal to diffusers' own `enable_layerwise_casting`; an fp8 `torch_dtype`
is refused with the hint."""

from __future__ import annotations

import pytest
import torch

import pipelines
from hooks.layerwise_casting import LayerwiseCastingHook
from pipelines import Pipeline
from placement.errors import PlanError
from placement.sizing import size_module

from pipeline_fixtures import generate, save_preset
from quantized_models import diffusers, real_storage, run, save_flux
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def test_a_model_is_planned_at_fp8_storage_and_runs_as_diffusers_casting(tmp_path):
    # Saved in its compute dtype, as real checkpoints are: our loader reads each weight straight into fp8, one
    # rounding; from a checkpoint in another dtype diffusers rounds twice (through torch_dtype first).
    dense = save_flux(tmp_path / "fp32")
    folder = tmp_path / "bf16"
    diffusers.FluxTransformer2DModel.from_pretrained(dense, torch_dtype=BF16).save_pretrained(folder)
    reference = diffusers.FluxTransformer2DModel.from_pretrained(folder, torch_dtype=BF16).eval()
    dense = size_module(reference).total
    reference.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)

    plan = pipelines.plan_model(folder, torch_dtype=BF16, layerwise_casting=FP8, max_memory={0: "1GiB"})
    component = next(iter(plan.components.values()))
    assert component.bytes == real_storage(reference) < 0.7 * dense
    assert component.dtype == "bfloat16 (torch_dtype; layerwise float8_e4m3fn)"

    model = pipelines.load_model(folder, torch_dtype=BF16, layerwise_casting=FP8, progress=False)
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == FP8  # read into fp8, upcast per layer
    assert model.norm_out.linear.weight.dtype == BF16  # diffusers' "norm" pattern keeps it
    assert_same_output(run(model), run(reference))


def test_a_pipeline_component_is_planned_small_and_cast_at_load(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    dense = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory={0: "1GiB"})
    cast = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory={0: "1GiB"},
                                              layerwise_casting={"transformer": "float8_e4m3fn"},
                                              call={"height": 64, "width": 64})
    assert cast.components["transformer"].bytes < 0.7 * dense.components["transformer"].bytes
    assert cast.components["vae"].bytes == dense.components["vae"].bytes
    assert cast.activations_accounted  # the estimate ran with the cast layers computing in bf16

    pipe = Pipeline.from_pretrained(folder, device_map="balanced", torch_dtype=BF16,
                                               layerwise_casting={"transformer": FP8}, progress=False)
    assert any(_casting_hook(module) for module in pipe.transformer.modules())
    assert pipe.placement_plan.components["transformer"].bytes == size_module(pipe.transformer).total
    assert torch.isfinite(generate(pipe).float()).all()


def _casting_hook(module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return any(isinstance(h, LayerwiseCastingHook) for h in [hook, *getattr(hook, "hooks", ())])


def test_an_fp8_torch_dtype_is_refused_with_the_hint(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    with pytest.raises(PlanError, match=r"storage dtype.*layerwise_casting=\{'transformer': torch.float8_e4m3fn\}"):
        Pipeline.from_pretrained(folder, device_map="balanced", torch_dtype={"transformer": FP8})
    with pytest.raises(ValueError, match="layerwise_casting names \\['unet'\\]"):
        Pipeline.plan_placement(folder, layerwise_casting={"unet": FP8})


@pytest.mark.parametrize("storage", [torch.float16, "bfloat16", torch.int8, torch.float32])
def test_a_storage_dtype_that_is_not_fp8_is_refused_at_plan_time(storage, tmp_path):
    """A 16-bit storage dtype was accepted, and the first call failed ("mat1 and mat2 must have the same dtype")."""
    folder, _ = save_preset(tmp_path / "tiny-flux")
    with pytest.raises(PlanError, match=r"layerwise_casting\['transformer'\]=.*must be an fp8 dtype"):
        Pipeline.plan_placement(folder, layerwise_casting={"transformer": storage}, max_memory={0: "1GiB"})


def test_the_cli_plans_with_layerwise_casting(tmp_path, capsys):
    from pipelines.cli import main

    folder, _ = save_preset(tmp_path / "tiny-flux")
    assert main(["plan", str(folder), "--max-memory", "0=1GiB", "--dtype", "bf16",
                 "--layerwise-casting", "transformer=fp8_e4m3fn"]) == 0
    assert "bfloat16 (torch_dtype; layerwise float8_e4m3fn)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # argparse's usage error: exit code 2, one line, no traceback
        main(["plan", str(folder), "--layerwise-casting", "transformer=int4"])
    assert refused.value.code == 2 and "transformer=fp8_e4m3fn" in capsys.readouterr().err
