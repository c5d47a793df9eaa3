"""The planner's word on guidance branches in parallel (`placement.guidance_choice`): where it applies, the replica's
memory charged to its GPU, the time model's seconds (about half the denoiser's compute, plus the copies between the
GPUs), the choice by predicted seconds or as asked, the reasons where it does not apply, and the Plan's JSON (old
files read, new ones round-trip)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import placement
from placement import Plan, PlanError
from placement.guidance import GuidanceCall, GuidanceMode
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD

MiB = 1 << 20
STEPS = 10
GPU = f"{ACCELERATOR_RUNTIME_OVERHEAD + 64 * MiB}B"  # room for the 16 MiB denoiser twice, and the rest


def components() -> dict[str, nn.Module]:
    with torch.device("meta"):
        return {"encoder": nn.Linear(256, 256), "denoiser": nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]),
                "decoder": nn.Linear(256, 256)}


def guidance(mode: GuidanceMode) -> dict[str, GuidanceCall]:
    return {"denoiser": GuidanceCall(mode=mode, seen=f"denoiser runs {mode.value}", input_bytes=4 * MiB,
                                     output_bytes=2 * MiB)}


def planned(mode=GuidanceMode.BATCH_OF_TWO, parallel=None, max_memory=None, runs=2 * STEPS, flops=True) -> Plan:
    runs = runs if mode is GuidanceMode.TWO_CALLS else STEPS
    work = {"flops_per_run": {"encoder": 10**9, "denoiser": 10**14, "decoder": 10**9},
            "bytes_touched_per_run": {"encoder": 10**6, "denoiser": 10**9, "decoder": 10**6}} if flops else {}
    return placement.plan(components(), max_memory=max_memory or {0: GPU, 1: GPU, "cpu": "4GiB"},
                          activations={"encoder": MiB, "denoiser": 8 * MiB, "decoder": MiB},
                          runs_per_call={"denoiser": runs}, gpu="h100", guidance=guidance(mode),
                          guidance_parallel=parallel, **work)


@pytest.mark.parametrize("mode", [GuidanceMode.BATCH_OF_TWO, GuidanceMode.TWO_CALLS])
def test_where_both_gpus_hold_the_denoiser_its_branches_run_in_parallel_for_about_half_the_time(mode):
    serial, plan = planned(mode, parallel=False), planned(mode)
    (record,) = plan.guidance_parallel
    assert record.applied and record.devices[0] == plan.components["denoiser"].execution_device
    assert record.seconds_parallel < 0.6 * record.seconds_one_gpu
    # the plan's seconds per call are the parallel ones, the rest unchanged
    saved = record.seconds_one_gpu - record.seconds_parallel
    assert plan.seconds_per_call == pytest.approx(serial.seconds_per_call - saved)
    # the replica's weights are resident on the other GPU, its activations in its phase
    replica = plan.device(record.devices[1])
    assert replica.weight_bytes == serial.device(record.devices[1]).weight_bytes + plan.components["denoiser"].bytes
    assert replica.phases["denoiser"] == record.replica_activation_bytes
    assert replica.left == replica.budget - replica.predicted_peak
    # the bytes between GPUs: half of each run's inputs and outputs (a batch of two), or one run's per pair
    per_run = 6 * MiB
    expected = STEPS * per_run // 2 if mode is GuidanceMode.BATCH_OF_TWO else STEPS * per_run
    assert record.peer_bytes_per_call == expected


def test_false_never_and_none_without_flops_does_not_guess():
    off = planned(parallel=False).guidance_parallel[0]
    assert not off.applied and off.reason.startswith("turned off (guidance_parallel=False)")
    unknown = planned(flops=False).guidance_parallel[0]
    assert not unknown.applied and "no gain can be predicted" in unknown.reason
    assert planned(flops=False, parallel=True).guidance_parallel[0].applied


def test_where_it_cannot_apply_the_plan_says_why():
    distilled = planned(GuidanceMode.NONE, parallel=True).guidance_parallel[0]
    assert not distilled.applied and "guidance distilled or off" in distilled.reason
    one = planned(parallel=True, max_memory={0: GPU, "cpu": "4GiB"}).guidance_parallel[0]
    assert not one.applied and "needs a second GPU" in one.reason
    # GPU 1 too small for a copy (16 MiB of weights and 4 MiB of activations beside its overhead)
    small = f"{ACCELERATOR_RUNTIME_OVERHEAD + 12 * MiB}B"
    tight = planned(parallel=True, max_memory={0: GPU, 1: small, "cpu": "4GiB"}).guidance_parallel[0]
    assert not tight.applied and "a second copy needs" in tight.reason and "GPU 1" in tight.reason
    # a denoiser that fits no GPU whole: split or streamed, no copy
    no_whole = f"{ACCELERATOR_RUNTIME_OVERHEAD + 14 * MiB}B"
    split = planned(parallel=True, max_memory={0: no_whole, 1: no_whole, "cpu": "4GiB"})
    assert split.components["denoiser"].kind.value != "whole"
    assert "only where the denoiser is whole on one GPU" in split.guidance_parallel[0].reason
    assert "guidance branches not in parallel" in planned(GuidanceMode.NONE).explain()


def test_guidance_parallel_takes_only_none_true_or_false():
    with pytest.raises(PlanError, match="guidance_parallel=1"):
        planned(parallel=1)


def test_the_record_round_trips_and_older_plans_read():
    plan = planned()
    again = Plan.from_json(plan.to_json())
    assert again.guidance_parallel == plan.guidance_parallel and again.inputs.guidance_parallel is None
    old = json.loads(plan.to_json())
    del old["guidance_parallel"]
    old["inputs"].pop("guidance_parallel")
    old["schema_version"] = 5
    assert Plan.from_json(json.dumps(old)).guidance_parallel == []
