"""Strategies and their fallbacks, the anchors' bugs as regressions, and bad input."""

import pytest
import torch

import placement
from placement import PlacementKind
from placement.sizes import GiB
from synthetic import component, whole


def kinds(plan):
    return {name: c.kind for name, c in plan.components.items()}


def on_accelerators(plan):
    return all(isinstance(d, int) for c in plan.components.values() for d in c.devices)


# --- regressions for diffusers' _assign_components_to_devices ----------------------------------------------


def test_6_5_3_3_on_10_and_7_loses_no_component():
    # diffusers: both 3 GiB components spill, and mapping["cpu"] = [name] keeps only one of them.
    comps = {"a": whole(6, 6), "b": whole(5, 5), "c": whole(3, 3), "d": whole(3, 3)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "7GiB", "cpu": "64GiB"})
    assert list(plan.components) == ["a", "b", "c", "d"]
    assert {key.split(".")[0] for key in plan.device_map} == {"a", "b", "c", "d"}
    assert on_accelerators(plan)  # 17 GiB on 17 GiB: the last one is split over the leftovers


def test_6_5_3_3_with_unsplittable_components_offloads_rather_than_drops():
    # Blocks of 0.75 GiB: the last 3 GiB component cannot be split over the 1 + 2 GiB left (3 of its 4 blocks
    # fit, with no room left for two in flight), so part of it lives in CPU RAM: one block stays resident on
    # GPU 1, and the three others stream to GPU 0 (two in flight: 1.5 GiB beside b's 5 and d's 3).
    comps = {"a": whole(6), "b": whole(5), "c": whole(3, 4), "d": whole(3, 4)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "7GiB", "cpu": "64GiB"})
    assert set(plan.components) == {"a", "b", "c", "d"}
    assert all(c.execution_device != "cpu" for c in plan.components.values())
    (fallback,) = plan.fallbacks
    assert fallback.kind is PlacementKind.OFFLOADED and "3.00 GiB" in fallback.reason
    offloaded = plan.components[fallback.component]
    assert offloaded.placed_bytes == {1: 3 * GiB // 4, "cpu": 9 * GiB // 4}
    # 2.25 GiB per call: less than the 3 GiB that streaming the whole component moves.
    assert plan.transfer_bytes_per_call == offloaded.transfer.streamed_per_run_bytes == 9 * GiB // 4


def test_24_9_quarter_and_small_on_two_24s_put_nothing_on_cpu():
    # diffusers: the 0.25 GiB component's turn is the full GPU 0, so it goes to the CPU while GPU 1 has room.
    comps = {"a": whole(24), "b": whole(9), "c": whole(0.25), "d": whole(0.17)}
    plan = placement.plan(comps, max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"})
    assert set(kinds(plan).values()) == {PlacementKind.WHOLE}
    assert plan.device_map == {"a": 0, "b": 1, "c": 1, "d": 1}
    assert plan.fallbacks == []


def test_component_bigger_than_any_gpu_but_smaller_than_their_sum_is_split():
    comps = {"encoder": whole(2, 2), "denoiser": whole(30, 15), "vae": whole(1)}
    plan = placement.plan(comps, max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"})
    denoiser = plan.components["denoiser"]
    assert denoiser.kind is PlacementKind.SPLIT and set(denoiser.devices) == {0, 1}
    assert on_accelerators(plan)
    (fallback,) = plan.fallbacks
    assert fallback.component == "denoiser" and "30.00 GiB" in fallback.reason and "Split" in fallback.reason


def test_split_beats_accelerates_reserve_for_the_largest_layer():
    # 20 blocks of 1 GiB on 10 + 10: accelerate keeps a block's room back on the first GPU and gives up.
    plan = placement.plan({"denoiser": whole(20, 20)}, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"})
    assert plan.components["denoiser"].placed_bytes == {0: 10 * GiB, 1: 10 * GiB}


def test_balanced_retries_least_divisible_first_when_largest_first_fragments():
    # Largest first puts the 8 GiB splittable component whole on GPU 0 and then has no room for the second
    # unsplittable 6; placing the unsplittable ones first lets the 8 GiB one fill the rest (4 + 4).
    comps = {"a": whole(6), "b": whole(6), "c": whole(8, 8)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "64GiB"})
    assert on_accelerators(plan)
    assert plan.components["c"].kind is PlacementKind.SPLIT
    assert plan.placement_order == ["a", "b", "c"]


def test_balanced_keeps_largest_first_when_it_fits():
    comps = {"small": whole(1), "big": whole(3, 3)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"})
    assert plan.placement_order == ["big", "small"]


# --- balanced ---------------------------------------------------------------------------------------------


def test_balanced_zigzags_largest_first():
    comps = {"a": whole(1), "b": whole(4), "c": whole(3), "d": whole(2)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"})
    # largest first: b(turn 0), c(turn 1), d(turn 1), a(turn 0)
    assert plan.device_map == {"a": 0, "b": 0, "c": 1, "d": 1}


def test_balanced_tries_other_gpus_before_any_fallback():
    comps = {"a": whole(8), "b": whole(1), "c": whole(3)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "4GiB", 2: "4GiB", "cpu": "1GiB"})
    # a -> 0 (8), c's turn is 1 (fits), b's turn is 2 (fits)
    assert plan.device_map == {"a": 0, "b": 2, "c": 1}
    plan = placement.plan({"a": whole(3), "b": whole(3)}, max_memory={0: "3GiB", 1: "5GiB", "cpu": "1GiB"})
    assert set(kinds(plan).values()) == {PlacementKind.WHOLE}


def test_auto_is_balanced():
    comps = {"a": whole(6, 6), "b": whole(5, 5), "c": whole(3, 3)}
    budgets = {0: "10GiB", 1: "7GiB", "cpu": "64GiB"}
    auto = placement.plan(comps, max_memory=budgets, strategy="auto")
    balanced = placement.plan(comps, max_memory=budgets, strategy="balanced")
    assert auto.components == balanced.components and auto.strategy == "auto"


def test_balanced_low_0_keeps_gpu_0_empty_while_others_have_room():
    comps = {"a": whole(4), "b": whole(3), "c": whole(2)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", 2: "10GiB", "cpu": "1GiB"}, strategy="balanced_low_0")
    assert 0 not in plan.device_map.values()
    assert plan.device(0).weight_bytes == 0


def test_balanced_low_0_reads_budgets_by_key_and_uses_0_last():
    comps = {"a": whole(6), "b": whole(5)}
    plan = placement.plan(comps, max_memory={1: "6GiB", 0: "10GiB", "cpu": "1GiB"}, strategy="balanced_low_0")
    assert plan.device_map == {"a": 1, "b": 0}


# --- sequential -------------------------------------------------------------------------------------------


def test_sequential_fills_gpus_in_execution_order():
    comps = {"encoder": whole(4), "denoiser": whole(5), "vae": whole(3), "post": whole(1)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, strategy="sequential")
    assert plan.device_map == {"encoder": 0, "denoiser": 0, "vae": 1, "post": 1}
    assert plan.crossing_edges == [("denoiser", "vae")]


def test_sequential_follows_the_graph_not_the_mapping():
    comps = {"vae": whole(3), "encoder": whole(8), "denoiser": whole(5)}
    graph = [("encoder", "denoiser"), ("denoiser", "vae")]
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, strategy="sequential", graph=graph)
    assert list(plan.components) == ["encoder", "denoiser", "vae"]
    assert plan.device_map == {"encoder": 0, "denoiser": 1, "vae": 1}


# --- fallbacks past split ---------------------------------------------------------------------------------


def test_offloaded_component_streams_to_the_gpu_with_most_room():
    comps = {"a": whole(9), "big": whole(8, 8)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "3GiB", "cpu": "64GiB"})
    big = plan.components["big"]
    assert big.kind is PlacementKind.OFFLOADED
    # its streaming working set: two 1 GiB blocks in flight (the current one and the prefetched next), on
    # GPU 1, which keeps room for them; one block resident beside them, and one beside a on GPU 0
    assert big.execution_device == 1 and big.streamed_unit_bytes == 2 * GiB
    assert big.placed_bytes == {0: GiB, 1: GiB, "cpu": 6 * GiB} and big.transfer.streamed_per_run_bytes == 6 * GiB
    assert {key: device for key, device in big.device_map.items() if device != "cpu"} == {"blocks.0": 1, "blocks.1": 0}
    assert plan.device(1).activation_peak == 2 * GiB and plan.device(1).predicted_peak == 3 * GiB
    assert plan.device("cpu").weight_bytes == 6 * GiB


def test_streaming_working_set_is_the_rest_plus_two_blocks():
    from placement.sizing import size_module
    from placement.streaming import streaming_working_set

    module = component([1, 3, 2], head=0.5)
    assert streaming_working_set(module, size_module(module)) == int(0.5 * GiB) + 3 * GiB + 2 * GiB
    flat = torch.nn.Linear(4, 4)  # no block list: nothing streams, the whole module is resident
    assert streaming_working_set(flat, size_module(flat)) == size_module(flat).total


def test_no_room_to_stream_runs_on_the_cpu():
    # b is one block: streaming it keeps all 5 GiB on the device, more than GPU 0 has even empty.
    # (A 3 GiB b would now be streamed with a demoted too: see test_no_needless_cpu.py.)
    comps = {"a": whole(4), "b": whole(5)}
    plan = placement.plan(comps, max_memory={0: "4GiB", "cpu": "64GiB"})
    assert kinds(plan) == {"a": PlacementKind.WHOLE, "b": PlacementKind.CPU}
    assert plan.components["b"].execution_device == "cpu"
    assert "runs on the CPU" in plan.fallbacks[0].reason


def test_disk_needed_without_offload_folder_is_an_error():
    comps = {"a": whole(4), "b": whole(6, 6)}
    with pytest.raises(placement.DoesNotFitError, match=r"b needs 6.00 GiB.*offload_folder"):
        placement.plan(comps, max_memory={0: "4GiB", "cpu": "2GiB"})


def test_disk_with_offload_folder(tmp_path):
    comps = {"a": whole(4), "b": whole(6, 6)}
    plan = placement.plan(comps, max_memory={0: "6GiB", "cpu": "2GiB"}, offload_folder=tmp_path)
    b = plan.components["b"]
    assert b.kind is PlacementKind.DISK and b.device_map == {"": "disk"} and b.execution_device == 0
    assert plan.device("disk").weight_bytes == 6 * GiB
    assert plan.fallbacks[0].kind is PlacementKind.DISK
    assert not list(tmp_path.iterdir())  # planning writes nothing


def test_disk_budget_is_respected(tmp_path):
    with pytest.raises(placement.DoesNotFitError, match="disk"):
        placement.plan({"a": whole(6, 6)}, max_memory={0: "2GiB", "cpu": "1GiB", "disk": "3GiB"}, offload_folder=tmp_path)


# --- dict strategy and pinned components ------------------------------------------------------------------


def test_dict_strategy_pins_and_balances_the_rest():
    comps = {"encoder": whole(4), "denoiser": component([2, 2, 2]), "vae": whole(1)}
    strategy = {"denoiser": {"blocks.0": 1, "blocks.1": 1, "blocks.2": 0}}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, strategy=strategy)
    denoiser = plan.components["denoiser"]
    assert denoiser.pinned and denoiser.kind is PlacementKind.SPLIT and denoiser.execution_device == 1
    assert denoiser.placed_bytes == {0: 2 * GiB, 1: 4 * GiB}
    assert plan.device_map["encoder"] == 0  # balanced around it: GPU 0 had the most room
    assert plan.strategy == "dict"


def test_dict_strategy_whole_device_and_string_devices():
    plan = placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB", "cpu": "4GiB"}, strategy={"a": "cuda:0", "b": "cpu"})
    assert plan.device_map == {"a": 0, "b": "cpu"}
    assert plan.components["b"].kind is PlacementKind.CPU


def test_dict_strategy_naming_a_missing_component():
    with pytest.raises(placement.PlanError, match=r"\['unet'\].*\['a', 'b'\]"):
        placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB"}, strategy={"unet": 0})


def test_dict_strategy_naming_a_device_without_budget():
    with pytest.raises(placement.PlanError, match=r"GPU 3, which has no budget"):
        placement.plan({"a": whole(1)}, max_memory={0: "4GiB", "cpu": "1GiB"}, strategy={"a": 3})


def test_dict_strategy_with_a_bad_device_or_submodule():
    with pytest.raises(placement.PlanError, match="'gpu'"):
        placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}, strategy={"a": "gpu"})
    with pytest.raises(placement.PlanError, match=r"\['blocks.7'\]"):
        placement.plan({"a": whole(2, 2)}, max_memory={0: "4GiB"}, strategy={"a": {"blocks.0": 0, "blocks.7": 0}})
    with pytest.raises(placement.PlanError, match="without a device.*blocks.1"):
        placement.plan({"a": whole(2, 2)}, max_memory={0: "4GiB"}, strategy={"a": {"blocks.0": 0}})


def test_dict_strategy_disk_needs_offload_folder(tmp_path):
    with pytest.raises(placement.DoesNotFitError, match="'a'"):
        placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}, strategy={"a": "disk"})
    plan = placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}, strategy={"a": "disk"}, offload_folder=tmp_path)
    assert plan.components["a"].kind is PlacementKind.DISK


def test_dict_strategy_over_an_explicit_budget_is_an_error():
    with pytest.raises(placement.DoesNotFitError, match="GPU 0: predicted 5.00 GiB > budget 4.00 GiB"):
        placement.plan({"a": whole(5)}, max_memory={0: "4GiB", "cpu": "8GiB"}, strategy={"a": 0})


def test_pinned_components_count_against_budgets_and_are_never_moved():
    comps = {"encoder": whole(6), "denoiser": whole(6), "vae": whole(1)}
    plan = placement.plan(comps, max_memory={0: "8GiB", 1: "8GiB", "cpu": "1GiB"}, pinned={"encoder": 0})
    assert plan.device_map == {"encoder": 0, "denoiser": 1, "vae": 1}
    assert plan.components["encoder"].pinned and not plan.components["denoiser"].pinned


def test_pinned_offloaded_mix_executes_on_its_accelerator():
    comps = {"denoiser": component([1, 1], head=1)}
    plan = placement.plan(comps, max_memory={0: "8GiB", "cpu": "8GiB"}, pinned={"denoiser": {"blocks": 0, "head": "cpu"}})
    denoiser = plan.components["denoiser"]
    assert denoiser.kind is PlacementKind.OFFLOADED and denoiser.execution_device == 0
    assert denoiser.placed_bytes == {0: 2 * GiB, "cpu": GiB}


def test_pinned_over_budget_is_a_warning_not_an_error():
    with pytest.warns(UserWarning, match="already placed exceed a budget"):
        plan = placement.plan({"a": whole(5), "b": whole(1)}, max_memory={0: "4GiB", 1: "4GiB", "cpu": "8GiB"}, pinned={"a": 0})
    assert plan.device_map == {"a": 0, "b": 1}
    assert plan.warnings


def test_pinned_and_dict_strategy_may_not_both_name_a_component():
    with pytest.raises(placement.PlanError, match=r"\['a'\]"):
        placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}, strategy={"a": 0}, pinned={"a": 0})


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fastest", "disk", "gpu", None, 1.5, True])
def test_unknown_strategy_lists_the_supported_ones(strategy):
    with pytest.raises(placement.PlanError, match=r"Unknown placement strategy .*'balanced', 'auto', 'sequential', 'balanced_low_0'"):
        placement.plan({"a": whole(1)}, max_memory={0: "4GiB"}, strategy=strategy)


def test_malformed_size_and_unknown_device_key():
    with pytest.raises(placement.PlanError, match="'4 gigs'"):
        placement.plan({"a": whole(1)}, max_memory={0: "4 gigs"})
    with pytest.raises(placement.InvalidDeviceError, match="'tpu'"):
        placement.plan({"a": whole(1)}, max_memory={"tpu": "4GiB"})


def test_graph_errors_surface_from_plan():
    with pytest.raises(placement.PlanError, match="cycle"):
        placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB"}, graph=[("a", "b"), ("b", "a")])
    with pytest.raises(placement.PlanError, match="'c'"):
        placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB"}, graph=[("a", "c")])


# --- odd modules and the CPU-only path --------------------------------------------------------------------


class WithActivationModule(torch.nn.Module):
    """Blocks with a parameter-less GELU between them: a split unit of 0 bytes."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.first = whole(4, 4).blocks
        self.act = torch.nn.GELU()
        self.second = whole(4, 4).blocks


def test_split_with_a_parameter_less_module():
    plan = placement.plan({"m": WithActivationModule()}, max_memory={0: "5GiB", 1: "5GiB", "cpu": "1GiB"})
    m = plan.components["m"]
    assert m.kind is PlacementKind.SPLIT and "act" in m.device_map  # a key with no tensors under it
    assert sum(m.placed_bytes.values()) == 8 * GiB and max(m.placed_bytes.values()) <= 5 * GiB


def test_cpu_only_goes_to_disk_when_ram_is_short(tmp_path):
    comps = {"encoder": whole(1), "denoiser": whole(6, 6)}
    with pytest.warns(UserWarning, match="degrades to 'cpu'"):
        plan = placement.plan(comps, max_memory={"cpu": "4GiB"}, offload_folder=tmp_path)
    assert kinds(plan) == {"encoder": PlacementKind.CPU, "denoiser": PlacementKind.DISK}
    assert plan.components["denoiser"].execution_device == "cpu"
    assert plan.fallbacks[0].component == "denoiser" and "CPU has 3.00 GiB left" in plan.fallbacks[0].reason
