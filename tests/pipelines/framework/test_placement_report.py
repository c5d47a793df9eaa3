"""Every placed run checks its plan (issue 38), on two strict virtual accelerators: `pipe.placement_report()` sets
the first calls' measured seconds per component beside the plan's; with a profile far off (a fake measurement
10^6 times too slow) the second call's figures correct it, the correction is saved to this machine's profile
once, and the report says what re-planning with it gives. The mechanics only: no test reads a time's value
(the times are the CPU's), only that a prediction 10^6 times too slow is off by more than 20%."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import placement
from hooks.run_timing import RunTiming
from pipelines import Pipeline
from pipelines.errors import CallError
from pipelines.loading.run_check import RunCheck, advice
from placement.machine_profile import (CACHE_ENV, VIRTUAL_NAME, DeviceMeasurement, MachineProfile, load_profile,
                                       save_profile)
from placement.plan_check import PlanCheck

from pipeline_fixtures import CALL, generate, module_components, save_preset
from same_output import assert_same_output

SIZES = {"height": CALL["height"], "width": CALL["width"], "num_inference_steps": CALL["num_inference_steps"]}
BUDGETS = {0: "2GiB", 1: "2GiB", "cpu": "4GiB"}
SLOW = DeviceMeasurement(index=0, name=VIRTUAL_NAME, kind="vgpu", pinned_copy_bytes_per_s=1e12,
                         memory_bytes_per_s=1e12, matmul_flops={"float32": 1e5, "bfloat16": 1e5})


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder, pipe = save_preset(tmp_path_factory.mktemp("report") / "tiny-flux")
    return folder, generate(pipe)


def load(folder):
    return Pipeline.from_pretrained(folder, device_map="balanced", max_memory=BUDGETS, call=SIZES, progress=False)


def test_a_far_off_profile_is_corrected_once_and_the_report_says_what_replanning_gives(machine, saved):
    folder, expected = saved
    save_profile(MachineProfile(measured_on="2026-12-08", gpus=[SLOW, SLOW.model_copy(update={"index": 1})]))
    pipe = load(folder)
    assert "profile: measured on this machine 2026-12-08" in pipe.placement_plan.gpu_source
    assert "No call timed yet" in pipe.placement_report()

    assert_same_output(generate(pipe), expected)  # timing changes nothing computed
    first = pipe.placement_report()
    assert "the first (it pays for warm-up)" in first and "corrected once 2 calls are timed" in first
    assert load_profile().corrections == {}  # the warm-up call corrects nothing

    assert_same_output(generate(pipe), expected)
    report = pipe.placement_report()
    lines = report.splitlines()
    assert lines[0].startswith("Plan: about") and "profile: measured on this machine" in lines[0]
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        row = next(line for line in lines if line.strip().startswith(name + " "))
        assert "measured" in row and "predicted" in row and row.endswith("<- off by more than 20%")
    assert f"Compute on {VIRTUAL_NAME} ran at" in report and "corrects its compute efficiency" in report
    correction = load_profile().corrections[VIRTUAL_NAME]
    assert correction.compute_scale > 1.2  # measured faster than the profile said: its throughput goes up
    assert any(line.startswith("  Saved to this machine's profile") for line in lines)
    assert any(line.startswith("  Re-planned with the corrected profile") for line in lines)
    # Asked again, nothing is applied twice; further calls are not timed (the hooks are gone).
    assert pipe.placement_report() == report and load_profile().corrections[VIRTUAL_NAME] == correction
    generate(pipe)
    assert pipe.placement_report() == report


def test_the_next_plan_uses_the_correction_and_reset_ends_the_report(machine, saved):
    folder, _ = saved
    save_profile(MachineProfile(measured_on="2026-12-08", gpus=[SLOW, SLOW.model_copy(update={"index": 1})])
                 .corrected(VIRTUAL_NAME, compute_scale=4.0, why="test"))
    pipe = load(folder)
    source = pipe.placement_plan.gpu_source
    assert "corrected by placed runs" in source and "compute x4" in source
    generate(pipe)
    pipe.reset_device_map()
    with pytest.raises(CallError, match="placement_report\\(\\): this pipeline is not placed"):
        pipe.placement_report()
    assert all(not module._forward_pre_hooks and not module._forward_hooks
               for module in module_components(pipe).values())  # reset takes the timing off too


class Blocks(nn.Module):
    """Four 256 KiB blocks on meta, each one a unit a plan may stream."""

    _no_split_modules = ["Linear"]

    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            self.blocks = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(4))


def test_the_advice_names_a_faster_placement_and_how_to_get_it(machine):
    def plan(max_memory):
        return placement.plan({"denoiser": Blocks()}, max_memory=max_memory,
                              runs_per_call={"denoiser": 4}, flops_per_run={"denoiser": 10**9})

    streamed = plan({0: "600KiB", "cpu": "1GiB"})
    resident = plan({0: "2GiB", "cpu": "1GiB"})
    assert streamed.transfer_bytes_per_call > 0 and resident.transfer_bytes_per_call == 0
    timing = RunTiming({"denoiser": 0}, {"denoiser": 4}, 2)
    found = PlanCheck(rows=(), device=VIRTUAL_NAME, compute_scale=2.0, cpu_scale=None, link=None,
                      predicted_link=streamed.link_bandwidth, call_index=1)
    lines = advice(RunCheck(plan=streamed, timing=timing, replan=lambda: resident), found)
    assert lines[0].startswith("  Re-planned with the corrected profile: another placement is predicted faster")
    assert "denoiser placed otherwise" in lines[0] and "Load the pipeline again with the same arguments" in lines[0]
    same = advice(RunCheck(plan=resident, timing=timing, replan=lambda: resident), found)
    assert "the same placement is still the best" in same[0]
    assert advice(RunCheck(plan=resident, timing=timing, replan=None), found)[0].startswith(
        "  To place it with the corrected profile: plan it again")


@pytest.mark.gpu
def test_on_cuda_the_report_times_by_events_and_names_the_gpu(tmp_path, monkeypatch, saved):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    folder, _ = saved
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "4GiB", "cpu": "4GiB"}, call=SIZES,
                                    progress=False)
    generate(pipe)
    generate(pipe)
    report = pipe.placement_report()
    assert "call 2 of the calls timed" in report
    for name in ("text_encoder", "transformer", "vae"):
        assert any(line.strip().startswith(f"{name} ") and "measured" in line for line in report.splitlines())
