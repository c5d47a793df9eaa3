"""Every input of the time model is checked where it enters (issue 42): a GPU profile's fields, a profile given as
fields, a PCIe 6 card, and the time fields of a plan file. Each bad value is a `PlanError` naming the field and the
value, never pydantic's raw ValidationError, a KeyError or a ZeroDivisionError."""

from __future__ import annotations

import json

import pytest
from torch import nn

import placement
from placement import Plan, PlanError
from placement.gpu_profiles import GpuProfile, PROFILES, gpu_profile

FIELDS = dict(key="mine", name="My GPU", bf16_tflops=100.0, fp32_tflops=50.0, memory_gb_s=1000.0, pcie_gen=5)


@pytest.mark.parametrize("change, message", [
    ({"bf16_tflops": -5}, r"field 'bf16_tflops' = -5: must be a positive finite number"),
    ({"fp32_tflops": 0}, r"field 'fp32_tflops' = 0"),
    ({"memory_gb_s": "fast"}, r"field 'memory_gb_s' = 'fast'"),
    ({"fp8_tflops": float("inf")}, r"field 'fp8_tflops' = inf"),
    ({"measured_link_bytes_per_s": -1e9}, r"field 'measured_link_bytes_per_s' = -1000000000.0"),
    ({"pcie_gen": 7}, r"field 'pcie_gen' = 7: must be a PCIe generation this library knows \(3, 4, 5, 6\)"),
    ({"pcie_gen": True}, r"field 'pcie_gen' = True"),
    ({"pcie_lanes": 3}, r"field 'pcie_lanes' = 3: must be one of 1, 2, 4, 8, 16"),
    ({"architecture": "kepler"}, r"field 'architecture' = 'kepler': must be one of ampere, ada"),
    ({"tensor_cores": 528}, r"unknown field 'tensor_cores' \(value 528\)"),
])
def test_a_bad_profile_field_is_named_with_its_value(change, message):
    with pytest.raises(PlanError, match=message):
        GpuProfile(**{**FIELDS, **change})
    with pytest.raises(PlanError, match=message):  # given as fields where a profile is taken
        gpu_profile({**FIELDS, **change})


def test_a_pcie_6_card_and_a_profile_given_as_fields_are_priced():
    card = gpu_profile({**FIELDS, "pcie_gen": 6, "architecture": "blackwell"})
    assert card.link_bytes_per_s > gpu_profile({**FIELDS, "architecture": "blackwell"}).link_bytes_per_s
    assert "PCIe 6.0 x16" in card.link_label and PROFILES["b300"].pcie_gen == 6
    plan = placement.plan({"a": nn.Linear(64, 64)}, max_memory={0: "1GiB", "cpu": "4GiB"},
                          flops_per_run={"a": 10**9}, gpu={**FIELDS, "pcie_gen": 6})
    assert plan.gpu.key == "mine" and plan.seconds_per_call > 0


def _plan_dict() -> dict:
    plan = placement.plan({"a": nn.Linear(64, 64)}, max_memory={0: "1GiB", "cpu": "4GiB"},
                          flops_per_run={"a": 10**9}, gpu="rtx4090", link_bandwidth=20e9)
    return json.loads(plan.to_json())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(link_bandwidth=-25e9), r"field 'link_bandwidth' = -25000000000.0: must be a positive"),
    (lambda d: d.update(link_bandwidth="25GB"), r"field 'link_bandwidth' = '25GB'"),
    (lambda d: d.update(disk_read_bandwidth=0), r"field 'disk_read_bandwidth' = 0"),
    (lambda d: d["inputs"].update(link_bandwidth=0), r"field 'inputs.link_bandwidth' = 0"),
    (lambda d: d["components"]["a"].update(flops_per_run=-5), r"field 'components.a.flops_per_run' = -5"),
    (lambda d: d["components"]["a"].update(bytes_touched_per_run=1.5), r"'components.a.bytes_touched_per_run' = 1.5"),
    (lambda d: d.update(gpu="rtx4090"), r"field 'gpu' = 'rtx4090'"),
    (lambda d: d["gpu"].update(memory_gb_s=0), r"in 'gpu': Invalid GPU profile: field 'memory_gb_s' = 0"),
    (lambda d: d["gpu"].update(pcie_gen=9), r"in 'gpu': .*field 'pcie_gen' = 9"),
    (lambda d: d.update(seconds_per_hour=3), r"unknown field 'seconds_per_hour' \(value 3\)"),
    (lambda d: d["components"]["a"].update(speed=1), r"unknown field 'components.a.speed'"),
])
def test_a_bad_time_field_in_a_plan_file_is_named_with_its_value(edit, message):
    data = _plan_dict()
    edit(data)
    with pytest.raises(PlanError, match=message) as error:
        Plan.from_json(json.dumps(data))
    assert "Invalid plan file" in str(error.value) and error.value.__cause__ is None


def test_a_plan_file_with_good_time_fields_still_loads_and_prices():
    data = _plan_dict()
    data["gpu"]["pcie_gen"] = 6
    loaded = Plan.from_json(json.dumps(data))
    assert loaded.gpu.pcie_gen == 6 and loaded.seconds_per_call > 0


@pytest.mark.parametrize("option", [{"link_bandwidth": 0}, {"link_bandwidth": -1}, {"disk_read_bandwidth": 0},
                                    {"disk_read_bandwidth": "zero"}])
def test_a_zero_or_negative_speed_given_to_plan_is_refused_before_any_division(option):
    with pytest.raises(PlanError, match=next(iter(option))):
        placement.plan({"a": nn.Linear(64, 64)}, max_memory={0: "1GiB", "cpu": "4GiB"}, **option)
