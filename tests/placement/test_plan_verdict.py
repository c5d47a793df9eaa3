"""The verdict a plan opens with, its warnings, the memory vocabulary, and the versioned JSON."""

import json
from pathlib import Path

import pytest

import placement
from placement import Plan
from placement.errors import PlanError
from placement.plan_schema import SCHEMA_VERSION, VerdictKind
from placement.sizes import GiB, format_bytes

from synthetic import component, whole

FIXTURE_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "plan_schema_v1.json"


def test_fits_on_accelerators_names_the_fullest_device_and_its_share():
    plan = placement.plan({"a": whole(3), "b": whole(1)}, max_memory={0: "4GiB", 1: "10GiB", "cpu": "64GiB"})
    verdict = plan.verdict
    assert verdict.kind is VerdictKind.FITS and verdict.warnings == []
    fullest = plan.device(verdict.fullest_device)
    assert verdict.fullest_share == pytest.approx(fullest.predicted_peak / fullest.budget)
    assert verdict.fullest_share == max(d.predicted_peak / d.budget for d in plan.devices if d.device != "cpu")
    assert plan.explain().splitlines()[0] == verdict.headline
    assert f"{verdict.fullest_share:.1%} of its budget" in verdict.headline


def test_a_device_with_under_five_percent_left_is_flagged():
    # 9.8 GiB on a 10 GiB card: 2% left.
    plan = placement.plan({"a": whole(9.8)}, max_memory={0: "10GiB", "cpu": "64GiB"})
    assert plan.verdict.kind is VerdictKind.FITS
    (warning,) = plan.verdict.warnings
    assert warning.startswith("GPU 0 is tight: 204.80 MiB left of 10.00 GiB (2.0%, under 5%)")
    assert "! GPU 0 is tight" in plan.explain()


def test_offloaded_components_give_the_verdict_and_their_cost_per_run(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")  # no CUDA GPU to time, on any machine: assumed
    plan = placement.plan({"big": component([0.5] * 16, head=0.5), "small": whole(1)},
                          max_memory={0: "4GiB", "cpu": "64GiB"})
    assert plan.components["big"].kind.value == "offloaded"
    assert plan.verdict.kind is VerdictKind.OFFLOADED
    # big keeps what fits beside small's phase and streams the rest at its one run.
    cost = next(w for w in plan.verdict.warnings if w.startswith("big keeps"))
    big = plan.components["big"].transfer
    assert f"streams {format_bytes(big.streamed_per_run_bytes)} from CPU RAM to GPU 0 at its one run" in cost
    assert f"{format_bytes(big.bytes_per_call)} per call, about" in cost and " ms." in cost
    total = plan.verdict.warnings[-1]
    assert total.startswith(f"Per call, {format_bytes(plan.transfer_bytes_per_call)} cross from host memory")
    assert "at 25 GB/s (assumed: PCIe 4.0 x16)" in total


def test_a_component_on_the_cpu_makes_the_plan_run_partly_on_the_cpu():
    plan = placement.plan({"a": whole(3), "b": whole(6)}, max_memory={0: "4GiB", "cpu": "64GiB"})
    assert plan.components["b"].execution_device == "cpu"
    assert plan.verdict.kind is VerdictKind.PARTLY_CPU
    assert any(w.startswith("b executes on the CPU: 6.00 GiB") for w in plan.verdict.warnings)


def test_pinned_components_over_budget_do_not_fit():
    with pytest.warns(UserWarning, match="exceed a budget"):
        plan = placement.plan({"a": whole(6)}, max_memory={0: "4GiB", "cpu": "64GiB"}, pinned={"a": 0})
    assert plan.verdict.kind is VerdictKind.NO_FIT
    assert any("GPU 0 is over its budget" in w and "2.00 GiB too much" in w for w in plan.verdict.warnings)


def test_the_device_table_splits_activations_from_the_streaming_working_set():
    activations = {"big": GiB // 2, "small": GiB // 4}
    plan = placement.plan({"big": component([0.5] * 16, head=0.5), "small": whole(1)},
                          max_memory={0: "4GiB", "cpu": "64GiB"}, activations=activations)
    gpu = plan.device(0)
    big = plan.components["big"]
    assert big.execution_device == 0 and big.streamed_unit_bytes > 0
    assert (gpu.activations, gpu.streaming_working_set) == (GiB // 2, big.streamed_unit_bytes)
    assert gpu.predicted_peak == gpu.weight_bytes + gpu.activations + gpu.streaming_working_set + gpu.overhead
    header = next(line for line in plan.explain().splitlines() if line.startswith("device"))
    assert header.split("  ")[0:1] == ["device"]
    for word in ("activations", "streaming working set", "runtime overhead", "predicted peak", "left"):
        assert word in header


def test_without_a_call_the_table_has_no_activations_column():
    plan = placement.plan({"big": component([0.5] * 16, head=0.5)}, max_memory={0: "4GiB", "cpu": "64GiB"})
    header = next(line for line in plan.explain().splitlines() if line.startswith("device"))
    assert "activations" not in header and "streaming working set" in header
    assert plan.device(0).activations is None and plan.device(0).streaming_working_set > 0


def test_the_left_in_a_reason_is_the_tables_left_when_nothing_was_placed_after_it():
    # "a" (pinned) is placed first, then "b" (one 5 GiB block: no split, no streaming) falls back to the CPU:
    # the left its reason quotes is the table's final left.
    plan = placement.plan({"a": whole(2.5), "b": whole(5)}, max_memory={0: "4GiB", "cpu": "64GiB"},
                          activations={"a": GiB // 4, "b": GiB // 4}, strategy={"a": 0})
    assert plan.placement_order == ["a", "b"]
    (fallback,) = plan.fallbacks
    assert "GPU 0 has 256.00 MiB left." in fallback.reason and plan.device(0).left == GiB // 4
    assert "256.00 MiB" in next(line for line in plan.explain().splitlines() if line.startswith("GPU 0"))
    assert "(in placement order; a reason's 'left' is the device's left when that component was placed)" in plan.explain()


def test_an_unused_gpu_reads_as_its_whole_budget_left_and_says_the_overhead_takes_it():
    plan = placement.plan({"a": whole(2)}, max_memory={0: "1GiB", "cpu": "64GiB"}, activations={"a": 1024})
    reason = plan.fallbacks[0].reason
    assert "GPU 0 has 1.00 GiB left (0 B for weights after its activations and the 1.00 GiB runtime overhead)" in reason
    assert plan.device(0).left == GiB


def test_the_plan_records_its_inputs_and_each_components_dtype():
    import torch

    plan = placement.plan({"a": whole(1)}, max_memory={0: "4GiB", "cpu": "64GiB"}, strategy="sequential",
                          dtype={"default": torch.bfloat16})
    assert plan.inputs.strategy == "sequential" and plan.inputs.dtype == {"default": "bfloat16"}
    assert plan.inputs.max_memory == {0: 4 * GiB, "cpu": 64 * GiB} and plan.inputs.call is None
    # The dtype the sizes assume, and where it came from.
    assert plan.components["a"].dtype == "bfloat16 (requested)"
    assert placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}).components["a"].dtype.startswith("float32")
    assert plan.with_inputs(call={"height": 64}).inputs.call == {"height": 64}


def test_json_carries_version_inputs_and_verdict_and_round_trips():
    plan = placement.plan({"big": component([0.5] * 16, head=0.5), "small": whole(1)},
                          max_memory={0: "4GiB", "cpu": "64GiB"}, activations={"big": GiB})
    data = json.loads(plan.to_json())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["verdict"]["kind"] == "fits with offloading" and data["inputs"]["max_memory"] == {"0": 4 * GiB, "cpu": 64 * GiB}
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.verdict == plan.verdict


def test_a_file_written_before_schema_version_still_loads():
    text = FIXTURE_V1.read_text()  # written by the code of commit 9d0f8a1, before the version existed
    assert "schema_version" not in text and "verdict" not in text
    plan = Plan.from_json(text)
    assert plan.schema_version == SCHEMA_VERSION and plan.inputs is None
    assert plan.verdict.kind is VerdictKind.OFFLOADED
    gpu = plan.device(0)  # 512 MiB of activations + the denoiser's 1.5 GiB streaming working set
    assert (gpu.activations, gpu.streaming_working_set) == (GiB // 2, 3 * GiB // 2)
    assert Plan.from_json(plan.to_json()) == plan


def test_a_newer_or_broken_file_is_refused_with_a_typed_error():
    data = json.loads(FIXTURE_V1.read_text())
    with pytest.raises(PlanError, match="schema_version 99; this library reads versions 1 to"):
        Plan.from_json(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(PlanError, match="Not a plan JSON file"):
        Plan.from_json("[1, 2]")


def test_the_json_schema_describes_what_to_json_writes():
    schema = Plan.model_json_schema(mode="serialization")
    assert {"schema_version", "inputs", "verdict", "devices", "components"} <= set(schema["properties"])
    assert "streaming_working_set" in schema["$defs"]["DevicePlan"]["properties"]


def test_a_plan_without_accelerators_says_so_once():
    with pytest.warns(UserWarning, match="No accelerator to plan for"):
        plan = placement.plan({"a": whole(1), "b": whole(2)}, max_memory={"cpu": "8GiB"})
    verdict = plan.verdict
    assert verdict.kind is VerdictKind.PARTLY_CPU and verdict.fullest_device == "cpu"
    assert verdict.headline.startswith("Verdict: runs on the CPU only (no accelerator holds or runs anything)")
    assert verdict.warnings == ["Every component executes on the CPU (3.00 GiB of weights at CPU speed, typically "
                                "10-100x slower than on a GPU)."]
