"""Resident blocks interleaved with streamed ones (issue 29): the same number of blocks kept and moved as before,
only which ones, so each streamed block's copy has kept compute before it to hide behind."""

from __future__ import annotations

import pytest

import placement
from placement.sizes import GiB
from placement.transfers.blocks import kept_evenly, moved_evenly, moved_positions

from test_transfers import ACTIVATIONS, pipeline


@pytest.mark.parametrize(("total", "count", "expected"), [
    (6, 2, [2, 5]), (6, 3, [1, 3, 5]), (6, 4, [1, 2, 4, 5]), (4, 4, [0, 1, 2, 3]), (5, 1, [4]), (3, 0, []),
])
def test_moved_blocks_end_equal_shares_of_the_run(total, count, expected):
    assert moved_positions(total, count) == expected


def test_every_moved_block_follows_a_kept_one_while_kept_ones_suffice():
    for total in range(1, 40):
        for count in range(total + 1):
            moved = moved_positions(total, count)
            assert len(moved) == count and moved == sorted(set(moved))
            if count <= total - count:
                assert all(index > 0 and index - 1 not in moved for index in moved)
            kept = kept_evenly(list(range(total)), total - count)
            assert sorted(kept + moved) == list(range(total))


def test_blocks_of_two_sizes_move_as_many_of_each_size_spread_within_it():
    blocks = [("double", 4)] * 4 + [("single", 1)] * 8
    units = [type("U", (), {"path": f"{kind}.{i}", "bytes": size})() for i, (kind, size) in enumerate(blocks)]
    moved = moved_evenly(units, {4: 1, 1: 4})
    assert [u.path for u in moved] == ["double.3", "single.5", "single.7", "single.9", "single.11"]


def test_the_planner_keeps_the_same_bytes_and_spreads_the_resident_blocks():
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    denoiser = plan.components["denoiser"]
    blocks = [f"blocks.{i}" for i in range(12)]
    # 7 of 12 blocks resident, 5 streamed (test_transfers holds the bytes); streamed ones ending each share.
    assert denoiser.transfer.streamed_modules == [blocks[i] for i in moved_positions(12, 5)]
    assert denoiser.transfer.streamed_per_run_bytes == 5 * GiB
    homes = [denoiser.device_map[block] for block in blocks]
    assert homes.count(0) == 7 and all(homes[i - 1] == 0 for i in moved_positions(12, 5))
    assert list(denoiser.device_map)[1:] == blocks  # the map reads in execution order
