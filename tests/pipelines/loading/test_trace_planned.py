"""Issue 29 end to end: a pipeline planned by the library (its transformer too deep to stay whole) keeps its resident
blocks interleaved with the streamed ones, and the runtime, traced on a strict virtual accelerator, runs them as
planned: every streamed block's copy issued before the kept block before it starts computing, the kept blocks
moving nothing, nothing copied twice in a run, the bytes of the plan, diffusers' own run's images, and the order
of copies and blocks `Plan.timeline()` predicts.

tiny-flux with eight single-stream blocks (the preset has one), at a budget (a fraction of its weights above the
GPU's 1 GiB of runtime overhead) where half of them stay resident."""

from __future__ import annotations

import pytest

from hooks import trace_calls
from pipelines import Pipeline
from placement.drawings import COMPUTE_START, COPY_ISSUED, predicted_events

from pipeline_fixtures import CALL, component_bytes, deeper_flux_folder, generate
from same_output import assert_same_output

GiB = 1024**3
SEQUENCE = {"max_sequence_length": 16}  # T5's prompt length: its activations at 512 tokens would dwarf the weights
PLANNED_CALL = {"height": CALL["height"], "width": CALL["width"], "num_inference_steps": CALL["num_inference_steps"],
                **SEQUENCE}
SINGLE = [f"single_transformer_blocks.{i}" for i in range(8)]
HALF_THE_SINGLE_BLOCKS = 0.8  # of the weights, on GPU 0: the double block and every other single block resident


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The deeper tiny-flux saved once, its weight bytes, and the images diffusers' own CPU pipeline makes."""
    folder = deeper_flux_folder(tmp_path_factory.mktemp("trace") / "deep-flux", num_single_layers=8)
    pipe = Pipeline.from_pretrained(folder, progress=False)  # diffusers' class, on the CPU, no placement
    return folder, sum(component_bytes(pipe).values()), generate(pipe, **SEQUENCE)


def transformer_runs(events):
    """The transformer's block events per run: (kind, block) between each of its runs' start and end."""
    runs, current = [], None
    for event in events:
        if event.component != "transformer":
            continue
        if event.block == "" and event.kind == COMPUTE_START:
            current = []
            runs.append(current)
        elif current is not None and event.block and event.kind in (COPY_ISSUED, COMPUTE_START):
            current.append((event.kind, event.block))
    return runs


def test_a_planned_streaming_run_interleaves_and_prefetches_as_its_plan_says(monkeypatch, saved):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, weights, expected = saved
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", call=PLANNED_CALL, progress=False,
                                    max_memory={0: GiB + int(HALF_THE_SINGLE_BLOCKS * weights), "cpu": GiB})
    plan = pipe.placement_plan
    transformer = plan.components["transformer"]
    streamed = transformer.transfer.streamed_modules
    # Half the single blocks stay resident, spread between the streamed ones (not the first four).
    assert streamed == SINGLE[1::2]
    assert [transformer.device_map[block] for block in SINGLE] == [0, "cpu"] * 4

    generate(pipe, **SEQUENCE)  # the first call learns the order the streamed blocks run in
    with trace_calls() as trace:
        images = generate(pipe, **SEQUENCE)
    assert_same_output(images, expected)
    runs = transformer_runs(trace.events)
    assert len(runs) == CALL["num_inference_steps"]
    for events in runs:
        started = [block for kind, block in events if kind == COMPUTE_START]
        copied = [block for kind, block in events if kind == COPY_ISSUED]
        assert [block for block in started if block in SINGLE] == SINGLE  # in execution order, each once
        assert sorted(copied) == sorted(streamed)  # each streamed block once; resident ones never
        for block in streamed:  # its copy goes before the resident block that hides it starts
            before = SINGLE[SINGLE.index(block) - 1]
            assert events.index((COPY_ISSUED, block)) < events.index((COMPUTE_START, before))
    copied_bytes = sum(event.nbytes for event in trace.events if event.kind == COPY_ISSUED)
    assert copied_bytes == plan.transfer_bytes_per_call  # nothing copied twice: the plan's bytes exactly

    def blocks_only(runs):
        return [[step for step in run if step[1] in SINGLE] for run in runs]

    assert blocks_only(runs) == blocks_only(transformer_runs(predicted_events(plan)))
    pipe.reset_device_map()
