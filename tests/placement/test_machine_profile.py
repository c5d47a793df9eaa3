"""This machine's profile (issue 38): `calibrate` on the CPU (no GPU) measures what there is and says what it could
not; the profile is saved atomically as versioned JSON in the cache folder; later plans made without gpu= use
it where the GPU present matches and name it; corrections multiply what a plan assumes; a file that is not a
profile is an error naming it. No test decides by the figures' values (the machine's speed): only that they are
there, positive, and reach the plan."""

from __future__ import annotations

import datetime
import json

import pytest

import placement
from placement.calibration import Shapes, calibrate
from placement.errors import PlanError
from placement.gpu_profiles import CPU_FORWARD_EFFICIENCY
from placement.machine_profile import (CACHE_ENV, VIRTUAL_NAME, DeviceMeasurement, MachineProfile, load_profile,
                                       machine_choice, profile_path, save_profile)

from synthetic import component

QUICK = Shapes(matmul=64, attention=(1, 64, 16), conv=(4, 16), copy_bytes=1 << 20, disk_bytes=8 << 20)
pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
FLOPS = 10**12  # a run's FLOPs, so that the plan predicts seconds and names the profile they assume


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    return tmp_path / "cache"


def plan_one(max_memory):
    return placement.plan({"denoiser": component([0.5, 0.5], unit=2**20)}, max_memory=max_memory,
                          flops_per_run={"denoiser": FLOPS})


def test_calibrate_without_a_gpu_measures_the_cpu_drive_and_ram_and_says_what_it_could_not(cache):
    said = []
    profile = calibrate(seconds=0.01, shapes=QUICK, say=said.append)
    host = profile.host
    assert profile.measured_on == datetime.date.today().isoformat() and profile.gpus == []
    assert all(rate > 0 for rate in [*host.matmul_flops.values(), *host.conv_flops.values()])
    assert set(host.matmul_flops) == {"float32", "bfloat16"}
    assert host.disk_read_bytes_per_s > 0 and host.disk_folder == str(cache) and host.ram_bytes > 0
    assert not [p for p in cache.iterdir() if p.name.startswith(".placement-disk-read-")]  # the temp file is gone
    assert any("no CUDA GPU" in line for line in profile.not_measured)
    assert any(line.startswith("CPU matmul float32") for line in said)


def test_the_profile_is_saved_as_versioned_json_and_a_cpu_plan_names_it(cache):
    path = save_profile(calibrate(seconds=0.01, shapes=QUICK, say=lambda _: None))
    assert path == profile_path() == cache / "machine-profile.json"
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["host"]["matmul_flops"]["float32"] > 0
    assert [p.name for p in cache.iterdir() if p.name != path.name and not p.name.startswith(".placement-disk")] == []

    plan = plan_one({"cpu": "1GiB"})  # no accelerator: everything on the CPU, priced by the measured CPU
    assert "CPU and disk: profile: measured on this machine" in plan.gpu_source and str(path) in plan.gpu_source
    assert plan.gpu.cpu_flops == pytest.approx(load_profile().host.matmul_flops["float32"] * CPU_FORWARD_EFFICIENCY)
    assert plan.disk_read_bandwidth == load_profile().host.disk_read_bytes_per_s
    assert "profile: measured on this machine" in plan.explain()
    named = placement.plan({"denoiser": component([0.5, 0.5], unit=2**20)}, max_memory={"cpu": "1GiB"},
                           flops_per_run={"denoiser": FLOPS}, gpu="h100")
    assert "profile" not in named.gpu_source and named.gpu.cpu_flops is None  # a named GPU: no machine figures


def test_virtual_accelerators_are_measured_once_and_plans_for_them_use_the_measurement(cache, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    profile = calibrate(seconds=0.01, shapes=QUICK, say=lambda _: None)
    assert [(g.index, g.name, g.kind) for g in profile.gpus] == [(0, VIRTUAL_NAME, "vgpu"), (1, VIRTUAL_NAME, "vgpu")]
    first = profile.gpus[0]
    assert first.pinned_copy_bytes_per_s > 0 and first.pageable_copy_bytes_per_s > 0
    assert all(first.matmul_flops.values()) and all(first.attention_flops.values()) and all(first.conv_flops.values())
    assert any("fp8 matmul" in line for line in profile.not_measured)
    save_profile(profile)
    plan = plan_one({0: "2GiB", 1: "2GiB", "cpu": "1GiB"})
    assert plan.gpu.name == VIRTUAL_NAME and plan.gpu_source.startswith("profile: measured on this machine")
    assert plan.link_bandwidth == first.pinned_copy_bytes_per_s
    assert plan.link_bandwidth_source.startswith("profile: measured on this machine")
    # The compute the plan assumes is the measured matmul rate at FORWARD_SHARE.
    assert plan.gpu.flops_per_s("float32") == pytest.approx(first.matmul_flops["float32"] * 0.8)


def test_a_correction_multiplies_the_compute_and_replaces_the_link_and_is_named(cache, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    measured = DeviceMeasurement(index=0, name=VIRTUAL_NAME, kind="vgpu", pinned_copy_bytes_per_s=4e9,
                                 matmul_flops={"float32": 1e11, "bfloat16": 2e11}, memory_bytes_per_s=1e10)
    profile = MachineProfile(measured_on="2026-12-08", gpus=[measured])
    save_profile(profile.corrected(VIRTUAL_NAME, compute_scale=0.5, link=1e9, why="test")
                 .corrected(VIRTUAL_NAME, compute_scale=0.5, why="again"))
    choice = machine_choice([0])
    assert choice.gpu.flops_per_s("float32") == pytest.approx(1e11 * 0.8 * 0.25)
    assert choice.link == (1e9, choice.link[1]) and "corrected by placed runs" in choice.link[1]
    assert "compute x0.25, link 1 GB/s" in choice.gpu.source
    assert load_profile().corrections[VIRTUAL_NAME].why == ["test", "again"]


def test_without_a_profile_plans_are_as_before_and_a_bad_file_is_named(cache):
    assert load_profile() is None and machine_choice([0]) is None
    before = plan_one({"cpu": "1GiB"})
    assert before.gpu_source == "assumed: no GPU named (gpu=) or present" and before.gpu.cpu_flops is None
    cache.mkdir(parents=True)
    profile_path().write_text("{not json")
    with pytest.raises(PlanError, match=r"machine-profile.json cannot be read .*placement calibrate"):
        plan_one({"cpu": "1GiB"})
    profile_path().write_text(json.dumps({"version": 99}))
    with pytest.raises(PlanError, match="version 99, newer than this library reads"):
        load_profile()


@pytest.mark.gpu
def test_calibrate_on_cuda_measures_each_gpu_and_a_plan_for_it_names_the_profile(cache):
    import torch

    profile = calibrate(seconds=0.05, shapes=QUICK, say=lambda _: None)
    assert [g.name for g in profile.gpus] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    first = profile.gpus[0]
    assert first.kind == "cuda" and first.pinned_copy_bytes_per_s > 0 and first.pageable_copy_bytes_per_s > 0
    assert {"bfloat16", "float16", "float32"} <= set(first.matmul_flops) and first.memory_bytes_per_s > 0
    assert set(first.attention_flops) == set(first.conv_flops) == {"bfloat16", "float16", "float32"}
    fp8 = torch.cuda.get_device_capability(0) >= (8, 9)
    assert ("float8_e4m3fn" in first.matmul_flops) == fp8 or any("fp8" in line for line in profile.not_measured)
    save_profile(profile)
    plan = plan_one({0: "4GiB", "cpu": "1GiB"})
    assert plan.gpu.name == first.name and plan.gpu_source.startswith("profile: measured on this machine")
    assert plan.link_bandwidth == first.pinned_copy_bytes_per_s


def test_measured_attention_conv_and_pageable_rates_feed_the_time_model_and_are_named(cache, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    from placement.machine_profile import FORWARD_SHARE
    from placement.pricing import ComponentWork, Mode, price

    measured = DeviceMeasurement(index=0, name=VIRTUAL_NAME, kind="vgpu", pinned_copy_bytes_per_s=4e9,
                                 pageable_copy_bytes_per_s=1e9, memory_bytes_per_s=1e12,
                                 matmul_flops={"float32": 1e11, "bfloat16": 2e11},
                                 attention_flops={"float32": 3e10, "bfloat16": 5e10}, conv_flops={"bfloat16": 4e10})
    save_profile(MachineProfile(measured_on="2026-12-08", gpus=[measured]))
    plan = plan_one({0: "2GiB", "cpu": "1GiB"})
    gpu = plan.gpu
    assert (gpu.measured_attention_tflops, gpu.measured_conv_tflops) == pytest.approx((0.05, 0.04 * FORWARD_SHARE))
    assert gpu.measured_pageable_link_bytes_per_s == 1e9
    assert "attention and conv at the rate measured on this machine" in plan.explain()
    # price(): each kind of FLOPs at its measured rate (attention at the SDPA's, convolutions at FORWARD_SHARE
    # of the 3x3 conv's), the matmuls at FORWARD_SHARE of the GEMM's; pageable copies at the measured rate.
    work = ComponentWork(name="vae", weight_bytes=10**6, matmul_flops=2e11, attention_flops=5e10, conv_flops=4e10)
    time = price([work], gpu)
    assert time.compute_s == pytest.approx(2e11 / (2e11 * FORWARD_SHARE) + 1.0 + 1 / FORWARD_SHARE)
    offloaded = price([work], gpu, {"vae": Mode(kind="group", pinned=False)})
    assert offloaded.copy_s == pytest.approx(10**6 / 1e9 + work.tensors * 50e-6)
    # Without a measured profile the same work takes the architecture's fitted shares, and explain() says so.
    fitted = placement.plan({"denoiser": component([0.5, 0.5], unit=2**20)}, max_memory={0: "2GiB", "cpu": "1GiB"},
                            flops_per_run={"denoiser": FLOPS}, gpu="rtx4090")
    assert fitted.gpu.measured_attention_tflops is None
    assert "attention and conv at ada's fitted shares of the peak" in fitted.explain()
    efficiency = fitted.gpu.efficiency
    assert price([work], "rtx4090").compute_s == pytest.approx(
        2e11 / (165.2e12 * efficiency.matmul) + 5e10 / (165.2e12 * efficiency.attention)
        + 4e10 / (165.2e12 * efficiency.conv))
