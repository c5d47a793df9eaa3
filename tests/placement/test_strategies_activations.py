"""The activation memory model: weights + the largest transient + runtime overhead stays under each budget."""

import pytest

import placement
from placement import ACCELERATOR_RUNTIME_OVERHEAD as OVERHEAD
from placement import PlacementKind
from placement.sizes import GiB
from synthetic import whole

BUDGETS = {0: "12GiB", 1: "12GiB", "cpu": "64GiB"}


def under_budget(plan):
    return all(d.budget is None or d.predicted_peak <= d.budget for d in plan.devices)


def test_fits_on_weights_alone_but_moves_when_activations_count():
    comps = {"encoder": whole(2), "denoiser": whole(10, 10), "vae": whole(1)}
    weights_only = placement.plan(comps, max_memory=BUDGETS)
    assert weights_only.components["denoiser"].kind is PlacementKind.WHOLE
    assert not weights_only.activations_accounted

    acts = {"encoder": GiB // 4, "denoiser": 2 * GiB, "vae": 3 * GiB}
    plan = placement.plan(comps, max_memory=BUDGETS, activations=acts)
    # 10 GiB + 2 GiB + 1 GiB overhead > 12 GiB: the denoiser is split over both GPUs instead
    assert plan.components["denoiser"].kind is PlacementKind.SPLIT
    assert plan.components["denoiser"].activation_bytes == 2 * GiB
    assert under_budget(plan)


def test_whole_component_goes_where_its_activations_fit():
    comps = {"a": whole(5), "b": whole(4)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "7GiB", "cpu": "8GiB"}, activations={"a": 3 * GiB, "b": GiB})
    # a (5 + 3 + 1 = 9) fits GPU 0, not GPU 1; b's turn is GPU 1 (4 + 1 + 1 = 6)
    assert plan.device_map == {"a": 0, "b": 1}
    assert plan.device(0).predicted_peak == 5 * GiB + 3 * GiB + OVERHEAD
    assert under_budget(plan)


def test_components_on_one_device_share_the_largest_activation_not_the_sum():
    comps = {"a": whole(2), "b": whole(2), "c": whole(2)}
    plan = placement.plan(comps, max_memory={0: "12GiB", "cpu": "8GiB"}, activations={"a": GiB, "b": 3 * GiB, "c": 2 * GiB})
    gpu = plan.device(0)
    assert set(plan.device_map.values()) == {0}
    assert gpu.activation_peak == 3 * GiB
    assert gpu.predicted_peak == 6 * GiB + 3 * GiB + OVERHEAD


def test_offloaded_execution_device_needs_room_for_a_block_and_the_activations():
    comps = {"a": whole(8), "big": whole(6, 6)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "4GiB", "cpu": "64GiB"}, activations={"a": 0, "big": GiB})
    big = plan.components["big"]
    assert big.kind is PlacementKind.OFFLOADED and big.execution_device == 1
    assert plan.device(1).activation_peak == GiB + 2 * GiB  # activations + two 1 GiB blocks in flight
    assert under_budget(plan)


def test_no_room_for_activations_anywhere_runs_on_cpu():
    plan = placement.plan({"a": whole(1)}, max_memory={0: "2GiB", "cpu": "8GiB"}, activations={"a": 2 * GiB})
    assert plan.components["a"].kind is PlacementKind.CPU
    assert plan.device("cpu").activation_peak == 2 * GiB
    assert plan.device(0).overhead == 0  # nothing runs there, so no CUDA context is charged


def test_overhead_is_charged_only_with_activations():
    comps = {"a": whole(10)}
    assert placement.plan(comps, max_memory={0: "10GiB", "cpu": "1GiB"}).device(0).overhead == 0
    plan = placement.plan(comps, max_memory={0: "10GiB", "cpu": "64GiB"}, activations={"a": 0})
    assert plan.components["a"].kind is not PlacementKind.WHOLE  # 10 GiB + 1 GiB overhead > 10 GiB


def test_activation_sizes_may_be_strings_and_missing_components_count_zero():
    plan = placement.plan({"a": whole(1), "b": whole(1)}, max_memory=BUDGETS, activations={"a": "512MiB"})
    assert plan.components["a"].activation_bytes == 512 * 1024**2
    assert plan.components["b"].activation_bytes is None
    with pytest.raises(placement.PlanError, match="'lots'"):
        placement.plan({"a": whole(1)}, max_memory=BUDGETS, activations={"a": "lots"})
