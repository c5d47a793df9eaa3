"""The Plan model and placement.plan()'s top-level behaviour: maps, JSON, explain, single devices, no GPU."""

import warnings

import pytest
import torch

import placement
from placement import PlacementKind, Plan
from placement.sizes import GiB

from synthetic import component, whole

TWO_GPUS = {0: "10GiB", 1: "10GiB", "cpu": "64GiB"}


def pipeline():
    return {"text_encoder": whole(2, 2), "denoiser": whole(12, 6), "vae": whole(1)}


def test_flat_and_relative_device_maps():
    plan = placement.plan(pipeline(), max_memory=TWO_GPUS)
    assert list(plan.components) == ["text_encoder", "denoiser", "vae"]
    denoiser = plan.components["denoiser"]
    assert denoiser.kind is PlacementKind.SPLIT
    assert set(denoiser.devices) == {0, 1}
    assert plan.component_device_map("denoiser") == denoiser.device_map
    flat = plan.device_map
    assert flat["text_encoder"] in (0, 1) and flat["vae"] in (0, 1)
    assert {k: v for k, v in flat.items() if k.startswith("denoiser.")} == {
        f"denoiser.{path}": device for path, device in denoiser.device_map.items()
    }
    with pytest.raises(KeyError, match="unet"):
        plan.component_device_map("unet")


def test_component_plan_records_bytes_dtype_and_execution_device():
    plan = placement.plan(pipeline(), max_memory=TWO_GPUS, dtype=torch.bfloat16)
    encoder = plan.components["text_encoder"]
    assert encoder.bytes == 1 * GiB  # 2 GiB of float32 halves in bf16
    assert encoder.dtype == "bfloat16 (requested)"
    assert encoder.kind is PlacementKind.WHOLE and encoder.device_map == {"": encoder.execution_device}
    assert sum(plan.components["denoiser"].placed_bytes.values()) == plan.components["denoiser"].bytes


def test_json_round_trip_keeps_ints_as_ints():
    plan = placement.plan(pipeline(), max_memory=TWO_GPUS, activations={"denoiser": GiB // 2})
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.device_map == plan.device_map
    assert all(isinstance(entry.device, int) for entry in again.devices[:2])
    assert all(isinstance(device, int) for device in again.components["denoiser"].placed_bytes)


def test_plan_is_frozen():
    plan = placement.plan(pipeline(), max_memory=TWO_GPUS)
    with pytest.raises(Exception):
        plan.strategy = "sequential"


def test_explain_is_a_table_with_peaks_and_reasons():
    text = placement.plan(pipeline(), max_memory=TWO_GPUS).explain()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("component"))
    assert "GPU 0" in header and "GPU 1" in header and "CPU" in header
    assert any(line.startswith("denoiser") and "split" in line for line in lines)
    assert "predicted peak" in text and "NOT accounted" in text
    assert "Fallbacks:" in text and "denoiser -> split" in text


def test_explain_with_activations_shows_them():
    plan = placement.plan(pipeline(), max_memory={0: "20GiB", "cpu": "8GiB"}, activations={"denoiser": GiB})
    assert plan.activations_accounted
    gpu = plan.device(0)
    assert gpu.activation_peak == GiB and gpu.overhead == placement.ACCELERATOR_RUNTIME_OVERHEAD
    assert gpu.predicted_peak == gpu.weight_bytes + gpu.activation_peak + gpu.overhead
    assert "Activations accounted for" in plan.explain()


@pytest.mark.parametrize("spec, device", [("cuda", 0), ("cuda:1", 1), (1, 1), (torch.device("cuda", 1), 1)])
def test_single_accelerator_strategy_puts_everything_there(spec, device):
    plan = placement.plan(pipeline(), max_memory={0: "20GiB", 1: "20GiB"}, strategy=spec)
    assert {c.kind for c in plan.components.values()} == {PlacementKind.WHOLE}
    assert set(plan.device_map.values()) == {device}
    assert plan.strategy == f"cuda:{device}"


def test_cpu_strategy_is_cpu_kind_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = placement.plan(pipeline(), max_memory={0: "20GiB", "cpu": "64GiB"}, strategy="cpu")
    assert {c.kind for c in plan.components.values()} == {PlacementKind.CPU}
    assert plan.device_map == {"text_encoder": "cpu", "denoiser": "cpu", "vae": "cpu"}


def test_single_device_over_an_explicit_budget_is_an_error_quoting_numbers():
    with pytest.raises(placement.DoesNotFitError, match=r"GPU 0: predicted 15.00 GiB > budget 10.00 GiB"):
        placement.plan(pipeline(), max_memory=TWO_GPUS, strategy="cuda")


def test_single_device_without_budget_is_an_error():
    with pytest.raises(placement.PlanError, match="GPU 3"):
        placement.plan(pipeline(), max_memory=TWO_GPUS, strategy="cuda:3")


@pytest.mark.parametrize("strategy", ["balanced", "sequential", "auto", "balanced_low_0", "cuda"])
def test_no_accelerator_degrades_to_cpu_with_one_warning(strategy):
    with pytest.warns(UserWarning) as caught:
        plan = placement.plan(pipeline(), max_memory={"cpu": "64GiB"}, strategy=strategy)
    assert len(caught) == 1 and "degrades to 'cpu'" in str(caught[0].message)
    assert plan.warnings == [str(caught[0].message)]
    assert plan.strategy == "cpu"
    assert set(plan.device_map.values()) == {"cpu"}


def test_a_pin_to_a_gpu_when_max_memory_lists_none_is_an_error_not_a_silent_cpu():
    with pytest.raises(placement.PlanError, match=r"pins 'vae' to GPU 0, but max_memory gives no budget"):
        placement.plan(pipeline(), max_memory={"cpu": "64GiB"}, strategy={"vae": 0})


def test_a_pin_to_a_gpu_on_a_machine_without_one_degrades_when_budgets_are_detected(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "0")
    tiny = {"text_encoder": whole(0.002), "denoiser": whole(0.004), "vae": whole(0.001)}  # fits any machine's RAM
    with pytest.warns(UserWarning, match="degrades to 'cpu'"):
        plan = placement.plan(tiny, strategy={"vae": 0})
    assert set(plan.device_map.values()) == {"cpu"}


def test_integer_keys_for_absent_gpus_plan_on_a_cpu_only_machine():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = placement.plan(pipeline(), max_memory={0: "24GiB", 1: "24GiB", 7: "24GiB", "cpu": "1GiB"})
    assert plan.accelerators == [0, 1, 7]
    assert set(plan.device_map.values()) <= {0, 1, 7}


def test_detected_budgets_say_so():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU-only machine this degrades to "cpu", with a warning
        plan = placement.plan({"vae": whole(0.001)})  # tiny: fits in whatever this machine has
    assert "keep back" in plan.budget_margin
    assert any(entry.detected for entry in plan.devices)
    assert "(detected)" in plan.explain()


def test_non_module_components_are_rejected():
    with pytest.raises(placement.PlanError, match="scheduler"):
        placement.plan({"vae": whole(1), "scheduler": object()}, max_memory=TWO_GPUS)


def test_activations_for_unknown_components_are_rejected():
    with pytest.raises(placement.PlanError, match="'unet'"):
        placement.plan(pipeline(), max_memory=TWO_GPUS, activations={"unet": 10})


def test_module_without_parameters_is_placed():
    plan = placement.plan({"identity": torch.nn.Identity(), "vae": component([1])}, max_memory=TWO_GPUS)
    assert plan.components["identity"].bytes == 0
    assert plan.components["identity"].kind is PlacementKind.WHOLE
