"""Maps a user finds natural at equal cost (issue 21): interchangeable GPUs are filled from GPU 0, and a
component split over several GPUs has balanced pieces, not a first GPU filled to the brim beside an empty one."""

from __future__ import annotations

import placement
from placement.sizes import GiB

from synthetic import component, whole


def test_a_small_pipeline_goes_to_gpu_0_not_to_gpu_1_beside_an_empty_gpu_0():
    # Tiny weights, activations and the runtime overhead dominate: one GPU holding everything is within 5% of
    # the best fullest share and crosses no edge. That GPU is GPU 0 (it was GPU 1: docs/memory.md's example).
    comps = {"text_encoder": whole(0.01), "denoiser": whole(0.02), "vae": whole(0.01)}
    plan = placement.plan(comps, max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"},
                          activations={"text_encoder": GiB // 100, "denoiser": GiB // 10, "vae": GiB // 10})
    assert set(plan.device_map.values()) == {0}
    assert plan.device(0).predicted_peak > 0 and plan.device(1).predicted_peak == 0


def test_distinct_gpus_are_not_relabelled():
    # GPU 1 is the larger one: the map that uses it is kept, not moved to the smaller GPU 0.
    comps = {"a": whole(6), "b": whole(1)}
    plan = placement.plan(comps, max_memory={0: "4GiB", 1: "24GiB", "cpu": "64GiB"},
                          activations={"a": GiB, "b": GiB})
    assert plan.components["a"].devices == [1]


def test_a_split_balances_its_pieces():
    # 20 GiB of 1 GiB blocks over two 12 GiB GPUs: filling GPU 0 first would leave it at 12 GiB and GPU 1
    # at 8; balanced pieces are 10 and 10.
    plan = placement.plan({"big": component([1] * 20)}, max_memory={0: "12GiB", 1: "12GiB", "cpu": "64GiB"})
    big = plan.components["big"]
    assert big.kind is placement.PlacementKind.SPLIT
    assert big.placed_bytes == {0: 10 * GiB, 1: 10 * GiB}
    shares = [plan.device(d).predicted_peak / plan.device(d).budget for d in (0, 1)]
    assert max(shares) - min(shares) < 0.05 and not plan.verdict.warnings  # no device is tight


def test_a_split_beside_a_resident_component_balances_the_shares_of_budget():
    # GPU 0 already holds a 6 GiB component: the split gives GPU 1 more, so both end about equally full
    # (13 GiB each, where filling GPU 0 first would leave 16 and 10).
    comps = {"first": whole(6), "big": component([0.5] * 40)}
    plan = placement.plan(comps, max_memory={0: "16GiB", 1: "16GiB", "cpu": "64GiB"}, strategy="sequential")
    big = plan.components["big"]
    assert big.kind is placement.PlacementKind.SPLIT
    peaks = [plan.device(d).predicted_peak for d in (0, 1)]
    assert abs(peaks[0] - peaks[1]) <= GiB // 2  # within one block
