"""The time model (issue 29): GPU profiles, FLOPs counted with the activation estimate, and a plan's seconds per call
(compute, copies, the copies compute does not hide), in the JSON, the verdict, explain() and the SVG."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import placement
from placement import Plan
from placement.errors import PlanError
from placement.gpu_profiles import (ARCHITECTURES, cpu_flops_per_s, DEFAULT_GPU, LINK_EFFICIENCY, MEMORY_EFFICIENCY,
                                    PROFILES, gpu_profile, match_device_name)
from placement.sizes import GiB

from synthetic import component, whole

ACTIVATIONS = {"text_encoder": GiB // 4, "denoiser": GiB, "vae": 2 * GiB}
LINK = 25e9
# float32 synthetic components compute at the RTX 4090's plain fp32 rate, at its architecture's stated efficiency.
FP32_RATE = 82.6e12 * ARCHITECTURES["ada"].matmul


def pipeline():
    """A text encoder and a denoiser of 1 GiB blocks with a 0.5 GiB rest each, and a small VAE (test_transfers')."""
    return {"text_encoder": component([1] * 8, head=0.5), "denoiser": component([1] * 12, head=0.5),
            "vae": whole(0.5, 2)}


def plan_for(flops, touched=None, **options):
    options = {"max_memory": {0: "12GiB", "cpu": "64GiB"}, "gpu": "rtx4090", "link_bandwidth": LINK, **options}
    return placement.plan(pipeline(), activations=ACTIVATIONS, runs_per_call={"denoiser": 28}, flops_per_run=flops,
                          bytes_touched_per_run=touched, **options)


# --- profiles ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, key", [
    ("rtx4090", "rtx4090"), ("RTX 4090", "rtx4090"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 5090", "rtx5090"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("a100", "a100-80gb"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("AMD Instinct MI300X", "mi300x"), ("h200", "h200"),
])
def test_a_gpu_is_found_by_its_key_its_vendor_name_or_what_cuda_calls_it(name, key):
    assert gpu_profile(name).key == key


def test_a_name_that_only_contains_a_shorter_key_is_not_that_gpu():
    assert match_device_name("NVIDIA L40") is None  # not an L4: "l4" is followed by a digit
    assert match_device_name("NVIDIA GeForce RTX 4080") is None


def test_an_unknown_gpu_is_refused_with_the_known_ones_and_the_closest():
    with pytest.raises(PlanError, match=r"Did you mean 'rtx4090'.*Known: rtx3060ti, rtx3090, rtx4090") as error:
        gpu_profile("rtx4080")
    assert isinstance(error.value, ValueError) and isinstance(error.value, PlanError)
    for key in PROFILES:
        assert key in str(error.value)
    with pytest.raises(PlanError, match="gpu="):
        placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, gpu="gtx 9000")


def test_every_profile_states_peaks_the_link_and_rates_at_the_stated_efficiencies():
    for profile in PROFILES.values():
        assert profile.bf16_tflops > profile.fp32_tflops > 0 and profile.memory_gb_s > 0
        assert profile.fp8_tflops is None or profile.fp8_tflops > profile.bf16_tflops
        assert profile.architecture in ARCHITECTURES  # every row states its efficiencies
        assert profile.flops_per_s("bfloat16 (requested)") == pytest.approx(profile.bf16_tflops * 1e12
                                                                             * profile.efficiency.matmul)
        assert profile.flops_per_s("float32 (as built)") == pytest.approx(profile.fp32_tflops * 1e12
                                                                          * profile.efficiency.matmul)
        assert profile.flops_per_s("nf4 (bitsandbytes), compute bfloat16 (checkpoint)") == \
            profile.flops_per_s("bfloat16")  # quantized weights compute in 16 bits
        assert profile.memory_bytes_per_s == pytest.approx(profile.memory_gb_s * 1e9 * MEMORY_EFFICIENCY)
    # PCIe 4.0 x16: 31.5 GB/s raw, 19.8 at the efficiency published copies reach; PCIe 5.0 twice that.
    assert gpu_profile("rtx4090").link_bytes_per_s == pytest.approx(31.504e9 * LINK_EFFICIENCY, rel=5e-3)
    assert gpu_profile("rtx5090").link_bytes_per_s == pytest.approx(2 * 31.504e9 * LINK_EFFICIENCY, rel=5e-3)
    assert gpu_profile("b300").link_bytes_per_s == pytest.approx(16 * 7.563e9 * LINK_EFFICIENCY, rel=5e-3)


# --- FLOPs counted with the estimate ---------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Tiny(nn.Module):
    """A convolution, a projection, four identical blocks (the block memo replays three), a batched matmul."""

    def __init__(self):
        super().__init__()
        self.conv, self.proj = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 32)
        self.blocks = nn.ModuleList([_Block() for _ in range(4)])

    def forward(self, image):
        hidden = self.proj(self.conv(image).flatten(2).transpose(1, 2))
        for block in self.blocks:
            hidden = block(hidden)
        return hidden @ hidden.transpose(1, 2)


@pytest.mark.parametrize("memo", ["1", "0"])
def test_flops_counted_on_fake_tensors_equal_flop_counter_mode_on_a_real_run(memo, monkeypatch):
    monkeypatch.setenv("PLACEMENT_BLOCK_MEMO", memo)  # replayed blocks count their first run's FLOPs again
    monkeypatch.setenv("PLACEMENT_ESTIMATE_CACHE", "0")
    model, image = _Tiny().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(image)
    assert counter.get_total_flops() > 0
    assert placement.estimate_call(model, (image,)).flops == counter.get_total_flops()
    with torch.device("meta"):
        on_meta = _Tiny()
    estimate = placement.estimate_call(on_meta, (image.to("meta"),), dtype=torch.bfloat16)
    assert estimate.flops == counter.get_total_flops()  # FLOPs do not depend on the dtype
    assert estimate.bytes_touched > sum(p.numel() * 2 for p in on_meta.parameters())  # every weight read once


def test_fused_attention_is_counted_as_its_two_matmuls():
    class Attention(nn.Module):
        def forward(self, query, key, value):
            return F.scaled_dot_product_attention(query, key, value)

    query, key = torch.empty(2, 4, 64, 16, device="meta"), torch.empty(2, 4, 32, 16, device="meta")
    value = torch.empty(2, 4, 32, 8, device="meta")
    flops = placement.estimate_call(Attention(), (query, key, value)).flops
    assert flops == 2 * (2 * 4 * 64) * 32 * 16 + 2 * (2 * 4 * 64) * 32 * 8


def test_the_estimate_cache_answers_with_the_flops_it_counted():
    with torch.device("meta"):
        model = _Tiny()
    image = torch.empty(1, 3, 8, 8, device="meta")
    first, again = placement.estimate_call(model, (image,)), placement.estimate_call(model, (image,))
    assert first.flops == again.flops > 0 and first.bytes_touched == again.bytes_touched > 0


# --- the time of a plan ----------------------------------------------------------------------------------------


def test_a_plans_seconds_are_the_hand_computed_compute_copies_and_exposed_copies():
    flops = {"text_encoder": round(0.1 * FP32_RATE), "denoiser": round(0.25 * FP32_RATE), "vae": 0}
    plan = plan_for(flops)
    encoder, denoiser, vae = (plan.components[name].transfer for name in ("text_encoder", "denoiser", "vae"))
    # The layout test_transfers holds: the denoiser keeps 7.5 of its 12.5 GiB and streams 5 blocks of 1 GiB at each
    # of its 28 runs; the encoder keeps its 0.5 GiB rest and streams its 8 blocks once; the VAE streams its 0.5 GiB.
    assert (denoiser.resident_bytes, denoiser.streamed_per_run_bytes, len(denoiser.streamed_modules)) == \
        (7.5 * GiB, 5 * GiB, 5)
    assert (encoder.streamed_per_run_bytes, len(encoder.streamed_modules)) == (8 * GiB, 8)
    copy = GiB / LINK  # one 1 GiB block
    # Denoiser: a run computes 0.25 s, a block 0.25 / 12.5 = 0.02 s < its copy. Its 7.5 GiB kept (0.15 s) sit
    # evenly between the 5 streamed blocks, 0.03 s before each: the first copy hides behind those, each later one
    # behind the streamed block before it and the kept ones between (0.05 s, longer than a copy: hidden).
    assert copy > 0.03
    denoiser_exposed = 28 * ((copy - 0.03) + 4 * max(0.0, copy - 0.05))
    # Encoder: 0.1 s over 8.5 GiB, all 8 blocks streamed; its 0.5 GiB rest's compute is spread before them.
    gap = 0.1 * 0.5 / 8.5 / 8
    encoder_exposed = (copy - gap) + 7 * (copy - 0.1 / 8.5 - gap)
    vae_exposed = vae.bytes_per_call / LINK  # no compute to hide behind
    time = plan.time_per_call()
    by_name = {c.name: c for c in time.components}
    assert by_name["denoiser"].compute_s == pytest.approx(28 * 0.25)
    assert by_name["denoiser"].copy_s == pytest.approx(28 * 5 * GiB / LINK)
    assert by_name["denoiser"].exposed_s == pytest.approx(denoiser_exposed)
    assert by_name["text_encoder"].exposed_s == pytest.approx(encoder_exposed)
    assert by_name["vae"].exposed_s == pytest.approx(vae_exposed) and by_name["vae"].compute_s == 0
    expected = 28 * 0.25 + 0.1 + denoiser_exposed + encoder_exposed + vae_exposed
    assert plan.seconds_per_call == pytest.approx(expected)
    assert time.copy_s == pytest.approx(plan.transfer_seconds_per_call)


def test_compute_longer_than_a_copy_hides_every_copy_but_the_first_without_resident_compute_before_it():
    memory_bound = round(10 * 1008e9 * MEMORY_EFFICIENCY)  # 10 s of memory traffic, no FLOPs
    plan = plan_for({"text_encoder": 0, "denoiser": 0, "vae": 0}, {"vae": memory_bound})
    vae = plan.components["vae"].transfer
    blocks = len(vae.streamed_modules)
    vae_time = next(c for c in plan.time_per_call().components if c.name == "vae")
    assert vae_time.compute_s == pytest.approx(10.0)  # the roofline: bytes touched at the memory bandwidth
    assert vae_time.exposed_s == pytest.approx(vae.streamed_per_run_bytes / blocks / LINK)  # only the first copy


def test_a_component_on_the_cpu_computes_at_this_cpus_measured_rate_moves_nothing_and_names_the_cpu():
    with pytest.warns(UserWarning, match="degrades to 'cpu'"):
        plan = placement.plan(pipeline(), max_memory={"cpu": "64GiB"}, flops_per_run={"denoiser": 10**12},
                              runs_per_call={"denoiser": 3})
    rate = cpu_flops_per_s("float32")  # measured once per process: the same figure the plan used
    assert 1e8 < rate < 1e14 and cpu_flops_per_s("float32") == rate
    denoiser = next(c for c in plan.time_per_call().components if c.name == "denoiser")
    assert denoiser.on_cpu and denoiser.compute_s == pytest.approx(3 * 10**12 / rate) and denoiser.copy_s == 0
    assert plan.seconds_per_call == pytest.approx(3 * 10**12 / rate)
    assert "per call on the CPU" in plan.verdict.time and "RTX 4090" not in plan.verdict.time


def test_a_plan_that_computes_one_component_on_the_cpu_names_it_beside_the_gpu():
    time = plan_for({"denoiser": 10**12}).time_per_call()
    assert time.device == "RTX 4090"
    mixed = dataclasses.replace(time, components=tuple(dataclasses.replace(c, on_cpu=c.name == "vae")
                                                        for c in time.components))
    assert mixed.device == "RTX 4090 (vae on the CPU)" and "on RTX 4090 (vae on the CPU), +-15%" in mixed.summary()


def test_without_flops_a_plan_states_bytes_only():
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS)
    assert plan.seconds_per_call is None and plan.verdict.time is None
    assert "Predicted" not in plan.explain() and "Predicted" not in plan.to_svg()


def test_the_gpu_assumed_is_stated_and_a_named_gpu_brings_its_link():
    flops = {"denoiser": 10**12}
    assumed = plan_for(flops, gpu=None, link_bandwidth=None)
    assert assumed.gpu.key == DEFAULT_GPU and assumed.gpu_source.startswith("assumed")
    assert "assumed: no GPU named" in assumed.verdict.time and "RTX 4090" in assumed.verdict.time
    assert assumed.link_bandwidth == 25e9  # the link assumed as before: nothing named
    named = plan_for(flops, gpu="rtx5090", link_bandwidth=None)
    assert named.gpu.key == "rtx5090" and named.gpu_source == "named (gpu=)" and named.inputs.gpu == "rtx5090"
    assert named.link_bandwidth == pytest.approx(gpu_profile("rtx5090").link_bytes_per_s) \
        and "PCIe 5.0 x16" in named.link_bandwidth_source
    assert named.seconds_per_call < assumed.seconds_per_call
    on_h100 = named.time_per_call("h100")  # the same plan on another GPU: float32 runs on its plain cores
    assert on_h100.gpu.key == "h100"
    rate = {key: gpu_profile(key).fp32_tflops * gpu_profile(key).efficiency.matmul for key in ("rtx5090", "h100")}
    assert on_h100.compute_s == pytest.approx(named.time_per_call().compute_s * rate["rtx5090"] / rate["h100"])


def test_the_time_shows_in_the_verdict_explain_and_the_svg():
    plan = plan_for({"text_encoder": 10**12, "denoiser": 10**13, "vae": 10**12})
    time = plan.time_per_call()
    assert plan.verdict.time.startswith(f"Predicted: about ") and "per call on RTX 4090, +-15%: compute" in plan.verdict.time
    assert "exposed" in plan.verdict.time and time.exposed_s < time.copy_s
    text = plan.explain()
    assert plan.verdict.time in text.splitlines()[:2]
    assert "Predicted time per call on RTX 4090" in text and "exposed" in text
    assert "Predicted: about" in plan.to_svg()


def test_the_time_survives_a_json_round_trip_and_older_files_load_without_it():
    plan = plan_for({"text_encoder": 10**12, "denoiser": 10**13, "vae": 10**12}, {"denoiser": 10**11})
    text = plan.to_json()
    data = json.loads(text)
    assert data["seconds_per_call"] == pytest.approx(plan.seconds_per_call)
    again = Plan.from_json(text)
    assert again == plan and again.seconds_per_call == plan.seconds_per_call
    assert again.components["denoiser"].flops_per_run == 10**13
    assert again.components["denoiser"].bytes_touched_per_run == 10**11 and again.gpu == plan.gpu
    old = dict(data, schema_version=3)  # before the time model: no FLOPs, no GPU
    for key in ("gpu", "gpu_source", "seconds_per_call"):
        old.pop(key)
    for entry in old["components"].values():
        entry.pop("flops_per_run"), entry.pop("bytes_touched_per_run")
    old["inputs"].pop("gpu")
    loaded = Plan.from_json(json.dumps(old))
    assert loaded.seconds_per_call is None and loaded.transfer_bytes_per_call == plan.transfer_bytes_per_call
    assert loaded.time_per_call().gpu.key == DEFAULT_GPU  # asked anyway: bytes at the default, compute unknown
    assert loaded.time_per_call().uncounted == list(plan.components)


@pytest.mark.parametrize("flops, match", [
    ({"unet": 1}, "names components that do not exist"), ({"denoiser": -1}, "ints >= 0"),
    ({"denoiser": 1.5}, "ints >= 0"), ([1], "must be a dict"),
])
def test_bad_flops_per_run_is_a_clear_error(flops, match):
    with pytest.raises(PlanError, match=match):
        placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, flops_per_run=flops)


def with_cpu_budget(plan: Plan, budget: int) -> Plan:
    devices = [d.model_copy(update={"budget": budget}) if d.device == "cpu" else d for d in plan.devices]
    return plan.model_copy(update={"devices": devices})


def test_a_host_budget_that_pins_half_of_what_moves_prices_its_copies_between_pinned_and_pageable():
    from placement.time_model import PAGEABLE_SHARE, host_copy_rate

    plan = plan_for({"text_encoder": round(0.1 * FP32_RATE), "denoiser": round(0.25 * FP32_RATE), "vae": 0})
    memory = plan.host_memory
    assert memory.pinned_share == 1.0 and memory.pinned_bytes > 0  # 64 GiB holds it all
    unpinned = memory.total_bytes - memory.pinned_bytes  # what stays pageable needs its room first
    half = with_cpu_budget(plan, unpinned + memory.pinned_bytes // 2)
    none = with_cpu_budget(plan, unpinned)
    assert half.host_memory.pinned_share == pytest.approx(0.5, abs=1e-9) and none.host_memory.pinned_share == 0.0
    assert "page-locks 50% of what moves" in half.host_memory.summary()
    pinned_s, half_s, pageable_s = (p.seconds_per_call for p in (plan, half, none))
    assert pinned_s < half_s < pageable_s
    # Half the bytes at the link, half at the pageable rate: their seconds per byte add.
    rate = host_copy_rate(LINK, 0.5)
    assert rate == pytest.approx(1 / (0.5 / LINK + 0.5 / (LINK * PAGEABLE_SHARE)))
    assert half.time_per_call().copy_s == pytest.approx(plan.transfer_bytes_per_call / rate)
    assert none.time_per_call().copy_s == pytest.approx(plan.transfer_bytes_per_call / (LINK * PAGEABLE_SHARE))
    assert plan.time_per_call().copy_s == pytest.approx(plan.transfer_seconds_per_call)  # all pinned: the link's


def test_a_measured_pageable_rate_prices_what_the_budget_cannot_pin():
    from placement.time_model import host_copy_rate

    plan = plan_for({"text_encoder": 0, "denoiser": round(0.25 * FP32_RATE), "vae": 0})
    unpinned = plan.host_memory.total_bytes - plan.host_memory.pinned_bytes
    measured = plan.gpu.model_copy(update={"measured_pageable_link_bytes_per_s": 5e9})
    short = with_cpu_budget(plan, unpinned)
    assert short.time_per_call(measured).copy_s == pytest.approx(plan.transfer_bytes_per_call / 5e9)
    assert host_copy_rate(LINK, 0.0, pageable=2 * LINK) == LINK  # a pageable copy never beats a pinned one
