"""Budgets: explicit max_memory used exactly as given; detected ones keep a documented margin."""

import warnings

import pytest

from placement import InvalidDeviceError, PlanError
from placement.budgets import (
    ACCELERATOR_MARGIN,
    CPU_MARGIN,
    MIN_ACCELERATOR_MARGIN,
    ZeroBudgetWarning,
    apply_accelerator_margin,
    apply_cpu_margin,
    detect_budgets,
    exact_budgets,
    resolve_budgets,
)
from placement.sizes import GiB


def test_explicit_budgets_are_exact_and_ordered():
    budgets = resolve_budgets({"cpu": "64GiB", 1: "10GB", "cuda:0": "1234B", "disk": "1TiB"})
    assert budgets.limits == {0: 1234, 1: 10 * 1000**3, "cpu": 64 * GiB, "disk": 1024 * GiB}
    assert budgets.accelerators == (0, 1)
    assert budgets.detected == frozenset()


def test_ten_gb_is_gigabytes_not_gigabits():
    assert resolve_budgets({0: "10gb", "cpu": "1B"}).limit(0) == 10 * 1000**3


def test_absent_gpus_are_accepted_and_disk_defaults_to_unlimited():
    budgets = resolve_budgets({5: "80GiB", 6: "80GiB", "cpu": "1GiB"})
    assert budgets.accelerators == (5, 6)
    assert budgets.limit("disk") is None


def test_missing_cpu_key_is_detected_with_margin():
    budgets = resolve_budgets({0: "24GiB"})
    assert budgets.detected == frozenset({"cpu"})
    assert budgets.limit("cpu") > 0


def test_malformed_size_names_the_key_and_quotes_the_value():
    with pytest.raises(PlanError, match=r"max_memory\[1\].*'24 gigs'"):
        resolve_budgets({0: "24GiB", 1: "24 gigs"})


def test_unknown_device_key_is_quoted():
    with pytest.raises(InvalidDeviceError, match="'gpu0'"):
        resolve_budgets({"gpu0": "24GiB"})


def test_two_spellings_of_one_device_are_rejected():
    with pytest.raises(InvalidDeviceError, match="twice"):
        resolve_budgets({0: "24GiB", "cuda:0": "20GiB"})


def test_max_memory_must_be_a_mapping():
    with pytest.raises(PlanError, match="must be a dict"):
        resolve_budgets(["24GiB"])


def test_margins_are_what_the_docstring_says():
    assert apply_accelerator_margin(40 * GiB) == 40 * GiB - int(40 * GiB * ACCELERATOR_MARGIN)
    assert apply_accelerator_margin(GiB) == GiB - MIN_ACCELERATOR_MARGIN  # 10% of 1 GiB < the minimum
    assert apply_accelerator_margin(100) == 0
    assert apply_cpu_margin(100 * GiB) == 100 * GiB - int(100 * GiB * CPU_MARGIN)


def test_detection_reads_accelerate(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: {0: 20 * GiB, 1: 10 * GiB, "cpu": 50 * GiB})
    budgets = detect_budgets()
    assert budgets.limits == {
        0: apply_accelerator_margin(20 * GiB),
        1: apply_accelerator_margin(10 * GiB),
        "cpu": apply_cpu_margin(50 * GiB),
        "disk": None,
    }
    assert budgets.detected == frozenset({0, 1, "cpu"})


def test_detection_on_this_machine_has_a_cpu_budget():
    budgets = resolve_budgets(None)
    assert budgets.limit("cpu") > 0 and "cpu" in budgets.detected


def test_a_budget_typed_without_a_unit_names_the_key_and_the_unit_it_lacks():
    with pytest.raises(PlanError, match=r"max_memory\[0\]: '24' means 24 bytes .*did you mean '24GiB'"):
        resolve_budgets({0: "24", "cpu": "64GiB"})
    with pytest.raises(PlanError, match=r"max_memory\[0\]: 24 means 24 bytes .*did you mean '24GiB'"):
        resolve_budgets({0: 24, "cpu": "64GiB"})
    assert resolve_budgets({0: "24B", "cpu": "1B"}).limit(0) == 24  # tiny budgets say their unit


def test_a_gpu_given_zero_as_text_is_warned_about_and_kept():
    with pytest.warns(ZeroBudgetWarning, match=r"gives GPU 1 a budget of 0 bytes: nothing can be placed there"):
        budgets = resolve_budgets({0: "24GiB", 1: "0GiB", "cpu": "0"})  # a zero CPU budget is not a listed GPU
    assert budgets.limits[1] == 0 and budgets.limits["cpu"] == 0
    with pytest.warns(ZeroBudgetWarning, match=r"gives GPU 0 a budget of 0 bytes"):
        resolve_budgets({0: 0, "cpu": "1GiB"})  # an int 0 as typed is the same: the GPU holds nothing


def test_exact_budgets_are_what_code_passes_for_bytes_it_computed():
    assert exact_budgets({0: 5000, "cpu": 24, "disk": None}) == {0: "5000B", "cpu": "24B"}
    assert resolve_budgets(exact_budgets({0: 5000, "cpu": 24})).limits == {0: 5000, "cpu": 24, "disk": None}
