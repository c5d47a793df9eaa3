"""When a plan does not fit resident, its warnings say which single change to one component would: computed by
planning again with that component stored as the change stores it (the same sizes a load with that option gets)."""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines import Pipeline
from placement.errors import PlacementError
from placement.plan_schema import VerdictKind
from placement.sizes import format_bytes

from pipeline_fixtures import save_preset
from quantized_models import diffusers, save_flux

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def suggestions(plan) -> list[str]:
    return [note for note in plan.advise() if note.startswith("Suggestion:")]


def _between_cast_and_dense(folder) -> int:
    """A GPU budget that holds the pipeline with its transformer in fp8 but not dense."""
    sizes = []
    for casting in (None, {"transformer": FP8}):
        plan = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory={0: "1GiB"}, layerwise_casting=casting)
        sizes.append(sum(component.bytes for component in plan.components.values()))
    return sum(sizes) // 2


def test_a_pipeline_that_streams_is_told_the_change_that_makes_it_fit(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    fits = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory={0: "1GiB"})
    budget = {0: f"{_between_cast_and_dense(folder)}B", "cpu": "1GiB"}
    plan = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory=budget)
    assert plan.verdict.kind is not VerdictKind.FITS
    cast = Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory=budget, layerwise_casting={"transformer": FP8})
    assert cast.verdict.kind is VerdictKind.FITS
    size = format_bytes(cast.components["transformer"].bytes)
    assert f"Suggestion: with transformer in fp8 layerwise casting ({size}) everything fits on GPU 0." in suggestions(plan)
    assert not suggestions(fits) and not suggestions(cast)


def test_a_diffusers_model_is_told_its_quantized_size(tmp_path):
    pytest.importorskip("torchao")
    folder = save_flux(tmp_path, layers=4)
    dense = pipelines.plan_model(folder, torch_dtype=BF16, max_memory={0: "1GiB"})
    budget = {0: f"{int(next(iter(dense.components.values())).bytes * 0.7)}B", "cpu": "1GiB"}
    plan = pipelines.plan_model(folder, torch_dtype=BF16, max_memory=budget)
    notes = suggestions(plan)
    assert len(notes) == 1 and "everything fits on GPU 0" in notes[0]
    # The least lossy change that fits is named, at the size a load with it is planned at.
    change = "fp8 layerwise casting" if "layerwise" in notes[0] else "int8 weight-only (torchao)"
    if change == "fp8 layerwise casting":
        other = pipelines.plan_model(folder, torch_dtype=BF16, max_memory=budget, layerwise_casting=FP8)
    else:
        from torchao.quantization import Int8WeightOnlyConfig
        other = pipelines.plan_model(folder, torch_dtype=BF16, max_memory=budget,
                                     quantization_config=diffusers.TorchAoConfig(Int8WeightOnlyConfig()))
    assert format_bytes(next(iter(other.components.values())).bytes) in notes[0]


def test_a_plan_that_cannot_fit_at_all_names_the_change_in_its_error(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    budget = {0: f"{_between_cast_and_dense(folder)}B", "cpu": "1024B"}  # no CPU room to offload anything to
    with pytest.raises(PlacementError, match="Suggestion: with transformer in fp8 layerwise casting"):
        Pipeline.plan_placement(folder, torch_dtype=BF16, max_memory=budget)
