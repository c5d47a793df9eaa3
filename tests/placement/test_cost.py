"""The cost model (`placement.cost`): the one bytes-per-call formula and stream-buffer rule, and everything that
counts bytes or buffers reading them rather than a copy of its own."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from placement.cost import (
    STREAM_BUFFER_BLOCKS, PlanCost, bytes_per_call, least_bytes_per_call, least_cost, least_moved, least_streamed_per_run,
    minimum_phase_weights, split_components, stream_buffer, stream_buffer_by_size, streaming_premium, working_set,
)
from placement.plan_schema import ComponentTransfer
from placement.sizing import size_module
from placement.strategies import ComponentRequest
from placement.streaming import TransferUnit, streaming_working_set
from placement.transfers.residency import HostSplit, split_host_part
from synthetic import component

GiB = 1024**3
sizes = st.lists(st.integers(1, 8), max_size=12)


def test_a_call_moves_what_it_loads_once_and_what_it_streams_at_every_run():
    assert bytes_per_call(loaded=3, streamed=2, runs=28) == 3 + 28 * 2
    assert least_bytes_per_call(10, runs=28) == 10  # loading everything once is the least any split moves
    assert streaming_premium(2, runs=28) == 27 * 2 and streaming_premium(5, runs=1) == 0


def test_the_plan_and_the_transfer_model_count_with_the_formula():
    transfer = ComponentTransfer(runs_per_call=7, loaded_per_call_bytes=5, streamed_per_run_bytes=3)
    assert transfer.bytes_per_call == bytes_per_call(loaded=5, streamed=3, runs=7)
    blocks = (TransferUnit(path="b.0", bytes=2, block=True), TransferUnit(path="b.1", bytes=1, block=True))
    split = HostSplit(per_call=(TransferUnit(path="rest", bytes=5, block=False),), streamed=blocks)
    assert split.bytes_per_call(7) == bytes_per_call(loaded=5, streamed=3, runs=7)
    assert split.buffer_bytes == stream_buffer([2, 1])


def test_the_blocks_in_flight_are_the_largest_streamed_ones():
    assert STREAM_BUFFER_BLOCKS == 2  # one computing, the next prefetched
    assert stream_buffer([1, 4, 2, 3]) == 4 + 3 and stream_buffer([5]) == 5 and stream_buffer([]) == 0
    assert working_set(10, [1, 4, 2]) == 10 + 4 + 2
    units = [TransferUnit(path="rest", bytes=10, block=False),
             *(TransferUnit(path=f"b.{i}", bytes=b, block=True) for i, b in enumerate([1, 4, 2]))]
    assert minimum_phase_weights(units) == working_set(10, [1, 4, 2])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sizes)
def test_the_buffer_by_size_is_the_buffer(blocks):
    counts = {size: blocks.count(size) for size in set(blocks)}
    assert stream_buffer_by_size(counts) == stream_buffer(blocks)


def test_the_least_a_component_streams_per_run_when_its_phase_is_short_of_room():
    assert least_streamed_per_run(10, 12, [1, 2]) == 0  # it fits: nothing must stream
    assert least_streamed_per_run(10, 6, [3, 1, 2, 4]) == 10 - 6 + (1 + 2)  # the excess and the smallest in flight
    assert least_streamed_per_run(10, 6, []) is None  # nothing to stream: it cannot run in that room


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sizes, st.integers(0, 40), st.integers(2, 30))
def test_a_split_never_moves_less_than_the_bound_and_always_fits_its_room(blocks, room, runs):
    units = (TransferUnit(path="rest", bytes=1, block=False),
             *(TransferUnit(path=f"b.{i}", bytes=b, block=True) for i, b in enumerate(blocks)))
    split = split_host_part(units, runs=runs, room=room)
    host = sum(unit.bytes for unit in units)
    assert split.bytes_per_call(runs) >= least_bytes_per_call(host, runs=runs)
    if split.fits:
        assert split.phase_weights <= room
        assert split.loaded_bytes + split.streamed_bytes == host


def test_a_bound_compares_below_every_cost_with_those_bytes():
    bound = PlanCost.at_least(5 * GiB)
    assert bound <= PlanCost(cpu_bytes=0, transfer_bytes=5 * GiB, crossing_edges=0, fullest_share=0.3)
    assert bound < PlanCost(cpu_bytes=1, transfer_bytes=0, crossing_edges=0)


def test_a_split_costs_more_than_a_fuller_accelerator_and_less_than_bytes_or_crossings():
    # A split is a fallback: at equal bytes and crossings, keeping components whole beats an emptier fullest GPU.
    whole = PlanCost(cpu_bytes=0, transfer_bytes=0, crossing_edges=0, split_components=1, fullest_share=0.941)
    spread = PlanCost(cpu_bytes=0, transfer_bytes=0, crossing_edges=0, split_components=2, fullest_share=0.923)
    assert whole < spread
    assert PlanCost(cpu_bytes=0, transfer_bytes=1, crossing_edges=0) > spread
    assert PlanCost(cpu_bytes=0, transfer_bytes=0, crossing_edges=1) > spread
    assert PlanCost.at_least(0) <= spread  # the search's bound stays a bound


def test_split_components_counts_the_components_over_more_than_one_accelerator():
    # Host devices are no split (offloading is priced in bytes); an accelerator named twice (weights and execution)
    # counts once; a block loaded per call onto another GPU is a device change too. Keeping one more component
    # whole beats spreading the split one over fewer GPUs: one over three GPUs counts as one.
    assert split_components([[0], [1, 1], ["cpu", 0], ["disk", "cpu", 1]]) == 0
    assert split_components([[0, 1], [0, 1, 2], ["cpu", 1, 0]]) == 3
    assert split_components([]) == 0


def test_the_bounds_leave_out_the_blocks_the_call_never_runs():
    # A VAE whose encoder the text-to-image call never runs: streamed, its idle blocks move nothing, so a bound
    # that counted them would exceed what the candidate moves and prune it.
    module = component([1, 1, 2, 2], head=1)
    size = size_module(module)
    request = ComponentRequest(name="vae", module=module, size=size, dtype=None, activation=0, position=0,
                               streamed=streaming_working_set(module, size),
                               idle=frozenset({"blocks.2", "blocks.3"}))
    runs = {"vae": 1}
    moved = split_host_part(request.layout_units, runs=1, room=None, idle=request.idle).bytes_per_call(1)
    assert moved == request.active_bytes == 3 * GiB < request.bytes
    assert least_moved([request], runs) == moved  # the search's bound, for a demotion and a STREAM level alike
    assert least_cost([request], runs) == PlanCost.at_least(moved)
