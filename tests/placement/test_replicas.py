"""placement.plan_replicas(): the group size chosen, mixed GPU sizes, real indices, the verdict, errors."""

from __future__ import annotations

import pytest

import placement
from placement import PlanError, ReplicaFit, ReplicaPlan
from synthetic import whole

GiB = 1024**3


def pipeline():
    """14 GiB in all: a 5 GiB encoder, an 8 GiB denoiser of 8 blocks, a 1 GiB decoder."""
    return {"encoder": whole(5, 5), "denoiser": whole(8, 8), "decoder": whole(1)}


def gpus(*sizes, cpu=256):
    return {**{index: size * GiB for index, size in enumerate(sizes)}, "cpu": cpu * GiB}


def test_smallest_group_that_holds_a_replica_gives_the_most_replicas():
    replicas = placement.plan_replicas(pipeline(), max_memory=gpus(*[8] * 8))
    assert (replicas.group_size, replicas.replicas, replicas.fit) == (2, 4, ReplicaFit.RESIDENT)
    assert [group.accelerators for group in replicas.groups] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replicas.verdict == "4 replicas of 2 GPUs; GPU 0–1, 2–3, 4–5, 6–7"
    assert replicas.explain().startswith("Replica plan: 4 replicas of 2 GPUs; GPU 0–1, 2–3, 4–5, 6–7")
    # One GPU each would stream the weights: 8 streamed replicas lose to 4 resident ones.
    one_each = next(option for option in replicas.options if option.group_size == 1)
    assert (one_each.replicas, one_each.fit) == (8, ReplicaFit.STREAMED)


def test_streamed_replicas_only_when_no_group_is_resident():
    replicas = placement.plan_replicas(pipeline(), max_memory=gpus(6, 6))
    assert (replicas.group_size, replicas.replicas, replicas.fit) == (1, 2, ReplicaFit.STREAMED)
    assert all(group.plan.components["denoiser"].kind is placement.PlacementKind.OFFLOADED for group in replicas.groups)
    assert "streamed" in replicas.verdict


def test_host_ram_is_shared_between_the_replicas():
    # On a 6 GiB GPU a replica streams its encoder and denoiser from RAM (13 GiB): 60 GiB hold four such
    # replicas (15 GiB each); 20 GiB (5 GiB each) hold none.
    roomy = placement.plan_replicas(pipeline(), max_memory=gpus(6, 6, 6, 6, cpu=60), group_size=1)
    assert (roomy.replicas, roomy.fit, roomy.cpu_share) == (4, ReplicaFit.STREAMED, 15 * GiB)
    assert all(group.max_memory["cpu"] == 15 * GiB for group in roomy.groups)
    tight = placement.plan_replicas(pipeline(), max_memory=gpus(6, 6, 6, 6, cpu=20), group_size=1)
    assert tight.replicas == 0


def test_a_big_gpu_pairs_with_a_small_one_when_that_makes_more_replicas():
    # 12 + 4 hold a replica; 12 + 12 would leave the 4s with nothing. GPUs 0, 1 are 12 GiB, 2, 3 are 4 GiB.
    replicas = placement.plan_replicas(pipeline(), max_memory=gpus(12, 12, 4, 4))
    assert (replicas.group_size, replicas.replicas) == (2, 2)
    assert sorted(sorted(group.accelerators) for group in replicas.groups) == [[0, 2], [1, 3]]
    assert replicas.verdict == "2 replicas of 2 GPUs; GPU 0,2, 1,3"


def test_device_indices_stay_real_for_non_contiguous_keys():
    replicas = placement.plan_replicas(pipeline(), max_memory={3: 16 * GiB, 5: 16 * GiB, "cpu": 64 * GiB})
    assert [group.accelerators for group in replicas.groups] == [[3], [5]]
    for group in replicas.groups:
        assert set(group.plan.device_map.values()) == set(group.accelerators)
        assert group.max_memory == {group.accelerators[0]: 16 * GiB, "cpu": 32 * GiB}


def test_group_size_given_is_used():
    replicas = placement.plan_replicas(pipeline(), max_memory=gpus(*[16] * 4), group_size=2)
    assert [group.accelerators for group in replicas.groups] == [[0, 1], [2, 3]]
    assert [option.group_size for option in replicas.options] == [2]


def test_nothing_fits_gives_an_empty_plan_that_says_so():
    replicas = placement.plan_replicas(pipeline(), max_memory=gpus(1, 1, cpu=2))
    assert replicas.replicas == 0 and replicas.unused == [0, 1]
    assert replicas.verdict.startswith("no replica fits")
    with pytest.raises(PlanError, match="Replica 0 does not exist"):
        replicas.group(0)


def test_json_round_trip_keeps_real_indices():
    replicas = placement.plan_replicas(pipeline(), max_memory={2: 16 * GiB, 7: 16 * GiB, "cpu": 64 * GiB})
    again = ReplicaPlan.from_json(replicas.to_json())
    assert again == replicas
    assert again.group(1).accelerators == [7] and again.group(1).plan.devices[0].device == 7


@pytest.mark.parametrize("group_size", [0, 3, 1.5, True])
def test_bad_group_size_is_a_typed_error(group_size):
    with pytest.raises(PlanError, match="group_size"):
        placement.plan_replicas(pipeline(), max_memory=gpus(16, 16), group_size=group_size)


def test_no_accelerators_is_a_typed_error():
    with pytest.raises(PlanError, match="need accelerators"):
        placement.plan_replicas(pipeline(), max_memory={"cpu": 64 * GiB})


def test_a_device_map_strategy_is_refused():
    with pytest.raises(PlanError, match="named strategy"):
        placement.plan_replicas(pipeline(), max_memory=gpus(16, 16), strategy={"encoder": 0})


def test_detected_budgets_of_like_gpus_are_evened_down(monkeypatch):
    import accelerate.utils

    free = {0: 20 * GiB + 7 * 2**20, 1: 20 * GiB, 2: 20 * GiB + 3 * 2**20, 3: 10 * GiB, "cpu": 64 * GiB}
    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: dict(free))
    replicas = placement.plan_replicas(pipeline(), max_memory=None)
    budgets = {index: group.max_memory[index] for group in replicas.groups for index in group.accelerators}
    evened = placement.budgets.apply_accelerator_margin(20 * GiB)
    assert {budgets[index] for index in (0, 1, 2) if index in budgets} == {evened}
    assert [group.accelerators for group in replicas.groups] == [[0], [1], [2]]
