"""`placement.price` (issue 38): the seconds of a placement the caller names, by the time model's stated rules,
checked against hand-computed figures; and every input checked where it enters."""

from __future__ import annotations

import pytest

import placement
from placement import ComponentWork, Mode, PlanError, price
from placement.gpu_profiles import gpu_profile
from placement.time_model import (ATTENTION_BACKENDS, BLOCK_SYNC_S, COMPILED_SPEEDUP, HOOK_TENSOR_S,
                                  HOST_WRITE_BYTES_PER_S, PAGEABLE_SHARE, PIN_BYTES_PER_S, TENSOR_COPY_S)

GB = 10**9
H100 = gpu_profile("h100")
PEAK = H100.bf16_tflops * 1e12
LINK = 40 * GB


def dit(**changes) -> ComponentWork:
    """A 28 GB DiT of 40 blocks (27 GB of them), 1100 tensors, 2 PFLOP of matmuls and 1 of attention per run."""
    fields = dict(name="transformer", weight_bytes=28 * GB, block_bytes=27 * GB, blocks=40, tensors=1100,
                  matmul_flops=2e15, attention_flops=1e15, runs=4)
    return ComponentWork(**{**fields, **changes})


def run_seconds(work: ComponentWork, gpu=H100) -> float:
    efficiency = gpu.efficiency
    return (work.matmul_flops / (gpu.bf16_tflops * 1e12 * efficiency.matmul)
            + work.attention_flops / (gpu.bf16_tflops * 1e12 * efficiency.attention))


def seconds(work, kind="resident", **mode):
    return price([work], H100, {work.name: Mode(kind=kind, **mode)}, link_bandwidth=LINK).components[0]


def test_resident_compute_is_each_kind_of_flops_at_its_share_of_the_peak():
    timed = seconds(dit())
    assert timed.compute_s == pytest.approx(4 * run_seconds(dit())) and timed.exposed_s == timed.copy_s == 0
    assert price([dit()], "h100").seconds == pytest.approx(4 * run_seconds(dit()))  # unnamed: resident
    compiled = seconds(dit(), compiled=True)
    assert compiled.compute_s == pytest.approx(timed.compute_s / COMPILED_SPEEDUP)
    fa3 = seconds(dit(), attention="flash3")
    attention = min(H100.efficiency.attention * ATTENTION_BACKENDS["flash3"], H100.efficiency.matmul)
    assert fa3.compute_s == pytest.approx(4 * (2e15 / (PEAK * H100.efficiency.matmul) + 1e15 / (PEAK * attention)))
    # a run reads its weights at least once: a tiny call is memory-bound, not free
    tiny = seconds(dit(matmul_flops=1.0, attention_flops=0.0))
    assert tiny.compute_s == pytest.approx(4 * 28 * GB / H100.memory_bytes_per_s)
    vae = ComponentWork(name="vae", weight_bytes=GB // 10, conv_flops=1e13)
    assert seconds(vae).compute_s == pytest.approx(1e13 / (PEAK * H100.efficiency.conv))


def test_whole_component_and_synchronous_copies_are_exposed_at_the_pinned_or_pageable_rate():
    pinned = seconds(dit(), "model_offload")
    assert pinned.exposed_s == pytest.approx(28 * GB / LINK + 1100 * TENSOR_COPY_S)
    diffusers = seconds(dit(), "model_offload", pinned=False, back_to_host=True)
    assert diffusers.exposed_s == pytest.approx(28 * GB / (LINK * PAGEABLE_SHARE) + 1100 * TENSOR_COPY_S
                                                + 28 * GB / HOST_WRITE_BYTES_PER_S)
    sequential = seconds(dit(), "sequential", pinned=False)
    assert sequential.exposed_s == pytest.approx(4 * (28 * GB / (LINK * PAGEABLE_SHARE) + 1100 * HOOK_TENSOR_S))
    group = seconds(dit(), "group", pinned=False)
    assert group.exposed_s == pytest.approx(4 * (28 * GB / (LINK * PAGEABLE_SHARE) + 1100 * TENSOR_COPY_S))
    assert group.compute_s == pinned.compute_s == sequential.compute_s == pytest.approx(4 * run_seconds(dit()))


def test_prefetched_blocks_hide_behind_compute_but_the_first_copy_and_the_hooks_sync():
    # compute-bound: a block computes 0.2 s (8 PFLOP-equivalents over 40 blocks), its copy takes 0.017 s
    streams = seconds(dit(), "group_streams")  # every weight moves, the rest's group with the blocks
    assert streams.exposed_s == pytest.approx(4 * (28 * GB / 40 / LINK + 40 * BLOCK_SYNC_S["hooks"]))
    engine = seconds(dit(), "group_streams", runtime="engine")
    assert engine.exposed_s == pytest.approx(4 * 28 * GB / 40 / LINK)
    block_copy = 27 * GB / 40 / LINK  # layerwise: the blocks alone stream, the rest stays resident
    # copy-bound (a tiny call): one copy stream, so the pass takes every copy back to back
    small = dit(matmul_flops=1e12, attention_flops=0.0)
    copy_bound = seconds(small, "layerwise", runtime="engine")
    block_compute = seconds(small).compute_s / 4 / 40  # memory-bound: its weights read once per run
    assert copy_bound.compute_s + copy_bound.exposed_s == pytest.approx(4 * (40 * block_copy + block_compute))


def test_resident_blocks_and_deeper_prefetch_never_cost_more_and_all_resident_is_resident():
    totals = [seconds(dit(), "layerwise", resident_blocks=n).total_s for n in (0, 10, 20, 30, 40)]
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] == pytest.approx(seconds(dit()).total_s)
    small = dit(matmul_flops=3e13, attention_flops=0.0)
    depths = [seconds(small, "layerwise", resident_blocks=20, prefetch=p).total_s for p in (1, 2, 8)]
    assert depths == sorted(depths, reverse=True)


def test_a_streamed_video_vae_pays_its_weights_once_per_chunk():
    vae = ComponentWork(name="vae", weight_bytes=GB, blocks=4, tensors=200, conv_flops=1e14)
    chunked = ComponentWork(name="vae", weight_bytes=GB, blocks=4, tensors=200, conv_flops=1e14, chunks=21)
    assert seconds(chunked, "group_streams").copy_s == pytest.approx(21 * seconds(vae, "group_streams").copy_s)
    assert seconds(chunked, "sequential").exposed_s > 20 * seconds(vae, "sequential").exposed_s
    assert seconds(chunked).total_s == pytest.approx(seconds(vae).total_s)  # resident: the chunks cost nothing more


def test_disk_homed_weights_copy_at_the_disks_speed():
    slow = price([dit()], H100, {"transformer": Mode(kind="model_offload", home="disk")}, link_bandwidth=LINK,
                 disk_read_bandwidth=2 * GB)
    assert slow.components[0].copy_s == pytest.approx(28 * GB / (2 * GB) + 1100 * TENSOR_COPY_S)


def test_pinning_per_onload_pays_the_host_pinning_exposed_on_top_of_the_pinned_copies():
    # synchronous kinds: every copy pinned first, then moved at the pinned rate
    group = seconds(dit(), "group", pin_per_onload=True)
    assert group.exposed_s == pytest.approx(4 * (28 * GB / LINK + 28 * GB / PIN_BYTES_PER_S + 1100 * TENSOR_COPY_S))
    whole = seconds(dit(), "model_offload", pinned=False, pin_per_onload=True)
    assert whole.exposed_s == pytest.approx(28 * GB / LINK + 28 * GB / PIN_BYTES_PER_S + 1100 * TENSOR_COPY_S)
    # streamed kinds: the copies still hide behind compute, the host's pinning does not (the launching thread pins)
    ahead = seconds(dit(), "group_streams", runtime="engine")
    onload = seconds(dit(), "group_streams", runtime="engine", pin_per_onload=True)
    assert onload.exposed_s - ahead.exposed_s == pytest.approx(4 * 28 * GB / PIN_BYTES_PER_S)
    assert onload.compute_s == ahead.compute_s
    layerwise = seconds(dit(), "layerwise", runtime="engine", resident_blocks=10, pin_per_onload=True)
    kept = seconds(dit(), "layerwise", runtime="engine", resident_blocks=10)
    assert layerwise.exposed_s - kept.exposed_s == pytest.approx(4 * 30 * (27 * GB / 40) / PIN_BYTES_PER_S)
    assert seconds(dit(), pin_per_onload=True).total_s == seconds(dit()).total_s  # resident: nothing loads


def test_a_pinned_budget_short_of_the_weights_pays_the_pageable_rate_for_the_rest():
    def group(**mode):
        return seconds(dit(), "group", **mode).exposed_s - 4 * 1100 * TENSOR_COPY_S

    assert group(pinned_bytes=28 * GB) == pytest.approx(group()) == pytest.approx(4 * 28 * GB / LINK)
    assert group(pinned_bytes=0) == pytest.approx(group(pinned=False))
    # a quarter pinned: a quarter of every copy at the link's rate, three quarters pageable
    assert group(pinned_bytes=7 * GB) == pytest.approx(4 * (7 * GB / LINK + 21 * GB / (LINK * PAGEABLE_SHARE)))
    streamed = [seconds(dit(matmul_flops=1e13), "layerwise", pinned_bytes=b).total_s for b in (28 * GB, 14 * GB, 0)]
    assert streamed == sorted(streamed)  # less pinned, never faster


@pytest.mark.parametrize("build, message", [
    (lambda: ComponentWork(name="t", weight_bytes=-1), r"t\.weight_bytes=-1 must be a non-negative"),
    (lambda: ComponentWork(name="t", weight_bytes=1, matmul_flops="many"), r"t\.matmul_flops='many'"),
    (lambda: ComponentWork(name="t", weight_bytes=1, runs=0), r"t\.runs=0 must be an int >= 1"),
    (lambda: ComponentWork(name="t", weight_bytes=1, block_bytes=2), r"block_bytes=2 exceeds weight_bytes=1"),
    (lambda: ComponentWork(name="t", weight_bytes=1, attention_flops=float("nan")), r"attention_flops=nan"),
    (lambda: Mode(kind="streamed"), r"kind='streamed' is not one of resident"),
    (lambda: Mode(attention="xformers4"), r"attention='xformers4'"),
    (lambda: Mode(kind="layerwise", resident_blocks=-2), r"resident_blocks=-2"),
    (lambda: Mode(prefetch=0), r"Mode\.prefetch=0"),
    (lambda: Mode(runtime="mine"), r"runtime='mine'"),
    (lambda: Mode(pinned_bytes=-1), r"pinned_bytes=-1 must be an int >= 0"),
    (lambda: Mode(pinned=False, pinned_bytes=4), r"pinned_bytes is the page-locked share .* needs pinned=True"),
    (lambda: price([dit()], H100, link_bandwidth=0), r"link_bandwidth=0 must be a positive"),
    (lambda: price([dit()], H100, disk_read_bandwidth=-3e9), r"disk_read_bandwidth=-3000000000.0"),
    (lambda: price([dit()], H100, {"unet": "resident"}), r"modes name 'unet', which are not among"),
    (lambda: price([dit()], "gtx9000"), r"gpu='gtx9000' names no GPU profile"),
    (lambda: price([dit()], {"key": "x", "name": "X", "bf16_tflops": 0, "fp32_tflops": 1, "memory_gb_s": 1,
                             "pcie_gen": 5}), r"field 'bf16_tflops' = 0: must be a positive"),
])
def test_every_pricing_input_is_checked_where_it_enters(build, message):
    with pytest.raises(PlanError, match=message):
        build()


def test_price_is_public_and_takes_a_mode_by_its_kind():
    assert placement.price is price
    by_kind = price([dit()], "h100", {"transformer": "group_streams"}, link_bandwidth=LINK)
    assert by_kind.seconds == pytest.approx(seconds(dit(), "group_streams").total_s)
    assert "H100" in by_kind.summary()
