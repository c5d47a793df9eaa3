"""Issue 29 end to end: a pipeline planned by the library (its denoiser too deep to stay whole) keeps its resident
blocks interleaved with the streamed ones, and the runtime, traced on a strict virtual accelerator, runs them as
planned: every streamed block's copy issued before the kept block before it starts computing, the kept blocks
moving nothing, nothing copied twice in a run, the bytes of the plan, the plain pipeline's images, and the order
of copies and blocks `Plan.timeline()` predicts.

tiny-dit with eight single-stream blocks (the preset has two), at a budget where half of them stay resident."""

from __future__ import annotations

import pytest
import torch

from hooks import trace_calls
from pipelines import TextToImagePipeline
from pipelines.text_to_image.models.dit import DiT
from pipelines.text_to_image.presets import build_preset_components
from placement.drawings import COMPUTE_START, COPY_ISSUED, predicted_events

from pipeline_fixtures import CALL, generate
from same_output import assert_same_output

KiB, GiB = 1024, 1024**3
PLANNED_CALL = {"height": CALL["height"], "width": CALL["width"], "num_inference_steps": CALL["num_inference_steps"]}
SINGLE = [f"single_blocks.{i}" for i in range(8)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The deeper tiny-dit saved once, and the images the plain in-memory CPU pipeline makes."""
    parts = build_preset_components("tiny-dit", seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        parts["denoiser"] = DiT(DiT.presets["tiny"].model_copy(update={"num_single_layers": 8})).eval()
    pipe = TextToImagePipeline(**parts)
    folder = tmp_path_factory.mktemp("trace") / "deep-dit"
    pipe.save_pretrained(folder)
    return folder, generate(pipe)


def denoiser_runs(events):
    """The denoiser's block events per run: (kind, block) between each of its runs' start and end."""
    runs, current = [], None
    for event in events:
        if event.component != "denoiser":
            continue
        if event.block == "" and event.kind == COMPUTE_START:
            current = []
            runs.append(current)
        elif current is not None and event.block and event.kind in (COPY_ISSUED, COMPUTE_START):
            current.append((event.kind, event.block))
    return runs


def test_a_planned_streaming_run_interleaves_and_prefetches_as_its_plan_says(monkeypatch, saved):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, expected = saved
    pipe = TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory={0: GiB + 760 * KiB,
                                               "cpu": GiB}, call=PLANNED_CALL, progress=False)
    plan = pipe.placement_plan
    denoiser = plan.components["denoiser"]
    streamed = denoiser.transfer.streamed_modules
    # Half the single blocks stay resident, spread between the streamed ones (not the first four).
    assert streamed == SINGLE[1::2]
    assert [denoiser.device_map[block] for block in SINGLE] == [0, "cpu"] * 4

    generate(pipe)  # the first call learns the order the streamed blocks run in
    with trace_calls() as trace:
        images = generate(pipe)
    assert_same_output(images, expected)
    runs = denoiser_runs(trace.events)
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

    assert blocks_only(runs) == blocks_only(denoiser_runs(predicted_events(plan)))
    pipe.reset_device_map()
