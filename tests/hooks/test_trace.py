"""The order the plan promises, read from `hooks.trace_calls()` on strict virtual accelerators (issue 29): each
streamed block's copy is issued before the compute that should hide it starts (the streamed block before it and
the kept blocks between the two; the run's first one, the blocks before it), resident blocks compute where the
plan put them and move nothing, nothing is copied twice in a run, the output is the unplaced model's, and the
trace is Chrome JSON that orders events as `Plan.timeline()` predicts them.

Virtual accelerators copy when asked (no side stream), so these tests hold the order, never the time."""

import json

import pytest
import torch

from hooks import apply_plan, trace_calls
from placement.drawings import COMPUTE_START, COPY_DONE, COPY_ISSUED, predicted_events
from transfer_pipeline import STEPS, assert_decoded, component, make, place_resident, plan, run

BLOCKS = [f"blocks.{i}" for i in range(6)]
STREAMED = ("blocks.1", "blocks.3", "blocks.5")  # interleaved as the planner spreads them (`blocks.moved_evenly`)
DENOISER_MAP = {"proj_in": 0, **{b: ("cpu" if b in STREAMED else 0) for b in BLOCKS}, "norm": 0, "proj_out": 0}


@pytest.fixture
def placed(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    modules = make()
    expected = run(modules)
    components = [component("encoder", modules["encoder"], {"": 0}),
                  component("denoiser", modules["denoiser"], DENOISER_MAP, streamed=STREAMED, runs=STEPS,
                            activation_bytes=0),
                  component("decoder", modules["decoder"], {"": 0})]
    resident = sum(c.placed_bytes.get(0, 0) for c in components)
    placement = plan(components, {0: resident + 20_000})
    place_resident(modules, placement)
    handles = apply_plan(modules, placement)
    yield modules, placement, expected
    handles.remove()


def traced_call(modules):
    run(modules)  # the first call learns the order the streamed blocks run in
    with trace_calls() as trace:
        output = run(modules)
    return trace, output


def runs_of(events, component="denoiser"):
    """The component's events, one list per run (between its own compute start and end)."""
    found, current = [], None
    for event in events:
        if event.component != component:
            continue
        if event.block == "" and event.kind == COMPUTE_START:
            current = []
            found.append(current)
        elif current is not None and event.block:
            current.append((event.kind, event.block))
    return found


def test_each_streamed_copy_is_issued_before_the_compute_that_hides_it(placed):
    modules, placement, expected = placed
    trace, output = traced_call(modules)
    assert_decoded(output, expected)  # the unplaced model's output (fp32: assert_same_output's tolerance)
    runs = runs_of(trace.events)
    assert len(runs) == STEPS
    for events in runs:
        computed = [block for kind, block in events if kind == COMPUTE_START]
        assert computed == BLOCKS  # every block once, in execution order
        for streamed in STREAMED:
            issued = events.index((COPY_ISSUED, streamed))
            before = BLOCKS[BLOCKS.index(streamed) - 1]  # a kept block: the compute that hides the copy
            assert issued < events.index((COMPUTE_START, before))
            assert issued < events.index((COPY_DONE, streamed)) < events.index((COMPUTE_START, streamed))
        later = STREAMED[1:]  # sent when the streamed block before it starts, so it hides behind that one too
        for previous, streamed in zip(STREAMED, later):
            assert events.index((COPY_ISSUED, streamed)) < events.index((COMPUTE_START, BLOCKS[
                BLOCKS.index(previous) + 1]))


def test_resident_blocks_move_nothing_and_nothing_is_copied_twice_in_a_run(placed):
    modules, placement, _ = placed
    trace, _ = traced_call(modules)
    for events in runs_of(trace.events):
        copied = [block for kind, block in events if kind == COPY_ISSUED]
        assert sorted(copied) == sorted(STREAMED)  # each streamed block once; no resident one
    assert not [e for e in trace.events if e.kind == COPY_ISSUED and e.component in ("encoder", "decoder")]
    moved = sum(e.nbytes for e in trace.events if e.kind == COPY_ISSUED)
    assert moved == placement.transfer_bytes_per_call  # the plan's bytes, each copy counted once
    assert {e.place for e in trace.events} == {0}


def test_the_trace_is_chrome_json_and_orders_events_as_the_predicted_timeline(placed, tmp_path):
    modules, placement, _ = placed
    trace, _ = traced_call(modules)
    trace.save(tmp_path / "run.json")
    loaded = json.loads((tmp_path / "run.json").read_text())
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and {"name", "ts", "pid", "tid"} <= set(e) for e in spans)
    assert {e["args"]["name"] for e in loaded["traceEvents"] if e["ph"] == "M"} >= {"GPU 0", "compute", "copy"}
    copies = [e for e in spans if e["cat"] == "copy"]
    assert len(copies) == STEPS * len(STREAMED) and all(e["args"]["bytes"] > 0 for e in copies)
    predicted = json.loads(json.dumps(placement.timeline()))  # JSON as the CLI writes it
    assert {e["cat"] for e in predicted["traceEvents"] if e["ph"] == "X"} == {"compute", "copy"}

    def promised(events):  # what the plan promises: the order of copies sent and blocks started (the runtime
        # traces the blocks of block lists; the timeline also the pieces of the rest, proj_in and the like)
        return [[(kind, block) for kind, block in run if kind in (COPY_ISSUED, COMPUTE_START) and block in BLOCKS]
                for run in runs_of(events)]

    assert promised(trace.events) == promised(predicted_events(placement))


def test_tracing_changes_nothing_and_records_nothing_once_off(placed):
    modules, _, expected = placed
    trace, output = traced_call(modules)
    count = len(trace.events)
    assert_decoded(run(modules), expected)
    assert len(trace.events) == count and count > 0
    with pytest.raises(RuntimeError, match="already on"):
        with trace_calls():
            with trace_calls():
                pass
    assert torch.equal(output, run(modules))
