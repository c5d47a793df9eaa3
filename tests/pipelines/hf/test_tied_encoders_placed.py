"""Every plan the planner makes of a text encoder loads and runs as transformers' own load does, or the planner
refuses it: a property over random budgets (one GPU holding any share of the encoder, host RAM ample or too small so
that some of it goes to disk), on the encoders diffusers pipelines use, tied or not (T5's `encoder.embed_tokens` is
`shared`; Gemma2's and Qwen2.5-VL's heads and embeddings). Each is one component of a generic pipeline folder, so
the whole pipeline planner places it (split, loaded per call, streamed, CPU, disk) on strict virtual GPUs."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines import Pipeline
from placement.errors import PlacementError
from same_output import assert_same_output
from transformers_families import build, output_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
ENCODERS = ["t5", "umt5", "clip_text", "gemma2", "qwen2_5_vl"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each encoder saved by transformers as the one component of a generic pipeline folder, with its output."""
    root, made = tmp_path_factory.mktemp("encoders"), {}
    for name in ENCODERS:
        model = build(name, layers=8)  # deep enough that a budget can split it, stream it or send blocks to disk
        folder = root / name
        model.save_pretrained(folder / "text_encoder")
        index = {"_class_name": "EncoderOnly", "text_encoder": ["transformers", type(model).__name__]}
        (folder / "model_index.json").write_text(json.dumps(index))
        weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())
        made[name] = (folder, weights, output_of(model, name))
    return made


@pytest.mark.parametrize("name", ENCODERS)
@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(share=st.floats(0.02, 1.4), host_room=st.sampled_from([None, 0.3]))
def test_every_plan_of_an_encoder_loads_and_runs_or_is_refused(folders, name, share, host_room, tmp_path_factory,
                                                               monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, weights, expected = folders[name]
    max_memory = {0: f"{max(int(share * weights), 1)}B",
                  "cpu": "4GiB" if host_room is None else f"{int(host_room * weights)}B"}
    offload = tmp_path_factory.mktemp("offload")
    try:
        pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory=max_memory, generic=True,
                                        offload_folder=offload, progress=False)
    except PlacementError:
        return  # refused by the planner, with its reason: never a load that breaks
    encoder = pipe.text_encoder
    if name in ("t5", "umt5"):
        assert encoder.shared.weight is encoder.encoder.embed_tokens.weight  # still one tensor
    assert_same_output(output_of(encoder, name), expected)
    assert_same_output(output_of(encoder, name), expected)  # and again: what moves per call comes back
    pipe.reset_device_map()
    assert_same_output(output_of(encoder, name), expected)


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("host_room, kind", [(None, "offloaded"), (0.3, "disk")])
def test_half_a_gpu_streams_the_encoder_from_the_host_or_the_disk(folders, name, host_room, kind, tmp_path,
                                                                  monkeypatch):
    """The property above may be refused; these budgets may not: half the encoder on the GPU streams the rest
    from host RAM, or from disk when host RAM is short too, and gives transformers' output."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, weights, expected = folders[name]
    max_memory = {0: f"{weights // 2}B", "cpu": "4GiB" if host_room is None else f"{int(host_room * weights)}B"}
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory=max_memory, generic=True,
                                    offload_folder=tmp_path, progress=False)
    assert pipe.placement_plan.components["text_encoder"].kind.value == kind
    assert_same_output(output_of(pipe.text_encoder, name), expected)
    assert_same_output(output_of(pipe.text_encoder, name), expected)
