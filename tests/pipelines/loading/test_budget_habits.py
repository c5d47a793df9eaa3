"""Budgets as people type them, at every user-facing entry: a bare number under 1 MiB is a unit left out
("did you mean '24GiB'?"), "5000B" is bytes, a GPU given 0 is warned about; a plan that fails with GPU budgets
given and the CPU's detected says so; a plan made in float32 that would do better in bfloat16 says that."""

from __future__ import annotations

import warnings

import pytest

import pipelines
import placement
from placement.budgets import DETECTED_CPU_NOTE, ZeroBudgetWarning
from placement.errors import PlacementError, PlanError
from pipelines import Pipeline
from pipelines.loading.suggestions import BF16_SUGGESTION

from pipeline_fixtures import budget, module_components, save_preset

UNIT_LEFT_OUT = r"max_memory\[0\]: 24 means 24 bytes \(a number without a unit counts bytes\): did you mean '24GiB'\?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("budgets") / "tiny-flux")[0]


@pytest.fixture(scope="module")
def pipe(folder):
    return Pipeline.from_pretrained(folder, progress=False)


def entries(folder, pipe):
    return {
        "from_pretrained": lambda mm: Pipeline.from_pretrained(folder, device_map="balanced", max_memory=mm,
                                                               progress=False),
        "plan_placement": lambda mm: Pipeline.plan_placement(folder, max_memory=mm),
        "placement.plan": lambda mm: placement.plan(module_components(pipe), max_memory=mm),
        "place": lambda mm: pipelines.place(pipe, max_memory=mm),
        "load_model": lambda mm: pipelines.load_model(folder / "vae", max_memory=mm, progress=False),
        "plan_replicas": lambda mm: placement.plan_replicas(module_components(pipe), max_memory=mm),
    }


@pytest.mark.parametrize("entry", ["from_pretrained", "plan_placement", "placement.plan", "place", "load_model",
                                   "plan_replicas"])
def test_a_bare_int_under_one_mib_is_a_unit_left_out_at_every_entry(folder, pipe, entry):
    with pytest.raises(PlanError, match=UNIT_LEFT_OUT):
        entries(folder, pipe)[entry]({0: 24, "cpu": "1GiB"})
    assert getattr(pipe, "hf_device_map", None) is None


@pytest.mark.parametrize("entry", ["plan_placement", "placement.plan"])
def test_explicit_bytes_still_plan_tiny_budgets(folder, pipe, entry):
    plan = entries(folder, pipe)[entry]({0: "5000B", 1: "5000B", "cpu": "1GiB"})
    assert {d.device: d.budget for d in plan.devices if d.device != "disk"} == {0: 5000, 1: 5000, "cpu": 2**30}


def test_replica_groups_plan_and_load_with_their_computed_budgets(folder, pipe, monkeypatch):
    """Budgets the library works out (a replica group's share) are never taken for a unit left out."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    modules = module_components(Pipeline.from_pretrained(folder, progress=False))
    # Each GPU holds a whole replica; the CPU's share (of a budget above the weights, under 1 MiB) is small.
    replicas = placement.plan_replicas(modules, max_memory={0: budget(4, pipe), 1: budget(4, pipe),
                                                            "cpu": budget(1.2, pipe)})
    assert replicas.cpu_share < 2**20 and len(replicas.groups) == 2
    group = replicas.groups[1]
    loaded = Pipeline.from_pretrained(folder, device_map="balanced", progress=False,
                                                 max_memory=placement.budgets.exact_budgets(group.max_memory))
    assert set(loaded.hf_device_map.values()) == {1}


def test_a_zero_budget_for_a_listed_gpu_is_a_warning_at_the_entries(folder):
    for zero in (0, "0GiB"):
        with pytest.warns(ZeroBudgetWarning, match="gives GPU 0 a budget of 0 bytes: nothing can be placed there"):
            plan = Pipeline.plan_placement(folder, max_memory={0: zero, 1: "1GiB", "cpu": "1GiB"})
        assert plan.components and all(0 not in c.devices for c in plan.components.values())


def test_a_failed_plan_with_gpu_budgets_and_a_detected_cpu_says_how_to_give_cpu(folder, pipe):
    with pytest.raises(PlacementError) as caught:
        placement.plan(module_components(pipe), max_memory={0: budget(0.6, pipe)}, strategy="balanced_low_0",
                       activations={"transformer": 2**50})  # needs more than any machine's RAM
    assert DETECTED_CPU_NOTE in str(caught.value) and "max_memory['cpu']" in str(caught.value)
    with pytest.raises(PlacementError) as given:
        placement.plan(module_components(pipe), max_memory={0: budget(0.6, pipe), "cpu": budget(0.2, pipe)})
    assert DETECTED_CPU_NOTE not in str(given.value)


def test_a_plan_in_float32_that_would_fit_in_bfloat16_says_so(folder, pipe):
    """Budgets as fractions of the float32 weights: bfloat16 halves them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offloaded = Pipeline.plan_placement(folder, max_memory={0: budget(0.6, pipe), 1: budget(0.25, pipe),
                                                                 "cpu": "100MiB"})
    assert offloaded.verdict.kind.value != "fits on accelerators"
    said = [line for line in offloaded.advise() if line.startswith(BF16_SUGGESTION)]  # worked out when asked
    assert said and "fits on accelerators" in said[0]
    with pytest.raises(PlacementError, match=r"no offload_folder was given.*" + BF16_SUGGESTION.replace("(", r"\(")
                       .replace(")", r"\)") + " fits on accelerators"):
        Pipeline.plan_placement(folder, max_memory={0: budget(0.7, pipe), "cpu": budget(0.2, pipe)})
    import torch
    in_bf16 = Pipeline.plan_placement(folder, torch_dtype=torch.bfloat16,
                                      max_memory={0: budget(0.6, pipe), 1: budget(0.25, pipe), "cpu": "100MiB"})
    assert not any(line.startswith(BF16_SUGGESTION) for line in in_bf16.warnings)
