"""`gpu="measure"`: this machine's CUDA GPU timed (a matmul, a device copy, a pinned host -> GPU copy) once per
process, its profile used by a plan's seconds; on CPU with a fake CUDA (events that report a fixed time), and for
real on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

import placement
import placement.gpu_profiles as link_speed
from placement import gpu_profiles
from placement.errors import PlanError
from placement.gpu_profiles import GEMM_EFFICIENCY, MEMORY_EFFICIENCY, choose_gpu, gpu_profile, measure_gpu_profile

from synthetic import component, whole

EVENT_MS = 10.0  # what a fake event pair reports for `MEASURE_REPEATS` runs of the work between them
SIDE, COPY = 64, 4096


class FakeEvent:
    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self, stream=None):
        FakeEvent.recorded += 1

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return EVENT_MS


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as seen from a process with one "NVIDIA H200"; the work runs on the CPU at small sizes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(gpu_profiles, "_cuda_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(gpu_profiles, "MATMUL_SIDE", SIDE)
    monkeypatch.setattr(gpu_profiles, "COPY_BYTES", COPY)
    monkeypatch.setattr(gpu_profiles, "_MEASURED", {})
    monkeypatch.setattr(link_speed, "measure_cuda_link", lambda index: 40e9)
    FakeEvent.recorded = 0


def test_a_measured_profile_turns_event_times_into_rates(fake_cuda):
    per_call = EVENT_MS / 1000 / gpu_profiles.MEASURE_REPEATS
    profile = measure_gpu_profile()
    assert profile.key == "measured" and profile.name == "NVIDIA H200"
    assert profile.bf16_tflops * 1e12 == pytest.approx(2 * SIDE**3 / per_call / GEMM_EFFICIENCY)
    assert profile.fp32_tflops == pytest.approx(profile.bf16_tflops)  # the fake times both alike
    assert profile.memory_gb_s * 1e9 == pytest.approx(2 * COPY / per_call / MEMORY_EFFICIENCY)
    assert profile.link_bytes_per_s == 40e9 and "measured pinned host -> GPU copy, 40.0 GB/s" == profile.link_label
    assert profile.fp8_tflops == gpu_profile("h200").fp8_tflops and profile.pcie_gen == 5  # the known chip's row
    assert profile.source.startswith("measured: cuda:0 is NVIDIA H200; bf16 matmul")


def test_the_measurement_runs_once_per_process_and_gpu(fake_cuda):
    first = measure_gpu_profile()
    recorded = FakeEvent.recorded
    assert recorded == 6  # three timed works, a start and an end event each
    assert measure_gpu_profile(0) is first and gpu_profile("measure") is first and gpu_profile("measured") is first
    assert FakeEvent.recorded == recorded


def test_an_unknown_gpu_is_measured_too(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Lab Accelerator X")
    profile = measure_gpu_profile()
    assert profile.name == "Lab Accelerator X" and profile.fp8_tflops is None and profile.link_bytes_per_s == 40e9


def test_choose_gpu_says_the_profile_was_measured(fake_cuda):
    profile, source = choose_gpu("measure", [0])
    assert profile.key == "measured" and source.startswith("measured: cuda:0 is NVIDIA H200")
    assert choose_gpu("h100", [0]) == (gpu_profile("h100"), "named (gpu=)")  # names stay deterministic


def test_a_plan_on_a_measured_profile_uses_its_rates(fake_cuda):
    measured = measure_gpu_profile()
    plan = placement.plan({"text_encoder": component([1] * 8, head=0.5), "vae": whole(0.5, 2)},
                          max_memory={0: "3GiB", "cpu": "64GiB"}, flops_per_run={"text_encoder": 10**12},
                          gpu=measured, link_bandwidth=None)
    assert plan.gpu == measured and plan.gpu_source.startswith("measured: cuda:0 is NVIDIA H200")
    time = plan.time_per_call()
    assert time.compute_s == pytest.approx(10**12 / measured.flops_per_s("float32"), rel=0.05)


def test_measure_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanError, match=r"gpu='measure' measures this machine's CUDA GPU"):
        gpu_profile("measure")


@pytest.mark.gpu
def test_a_real_gpu_measures_near_its_datasheet():
    profile = measure_gpu_profile()
    assert profile.source.startswith(f"measured: cuda:{torch.cuda.current_device()} is ")
    assert 1e9 < profile.link_bytes_per_s < 200e9 and 1 < profile.bf16_tflops < 5000
    known = gpu_profiles.match_device_name(torch.cuda.get_device_name())
    if known is not None:  # within a factor of 2 of the datasheet peak (power caps and clocks vary)
        assert 0.5 < profile.bf16_tflops / known.bf16_tflops < 2
        assert 0.5 < profile.memory_gb_s / known.memory_gb_s < 2
