"""Keyword habits at the Python entries: a misspelt keyword is "unknown keyword 'max_mem' (did you mean
max_memory?)", never "has no component(s)"; diffusers' own loading keywords are accepted where each load here does
what they ask anyway, refused by name with the reason otherwise; a keyword that is a component still passes it."""

from __future__ import annotations

import inspect

import pytest

import pipelines
from pipelines import LoadError, Pipeline, UnknownKeywordError
from pipelines.loading.request import PIPELINE_ARGUMENTS

from pipeline_fixtures import save_preset

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("keywords") / "tiny-flux")[0]


def test_the_pipeline_argument_list_is_the_entries_signatures():
    named = set()
    for entry in (Pipeline.from_pretrained, Pipeline.plan_placement):
        named |= {name for name, p in inspect.signature(entry).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(PIPELINE_ARGUMENTS) == named


@pytest.mark.parametrize("entry", ["from_pretrained", "plan_placement"])
def test_a_misspelt_pipeline_keyword_names_the_argument_it_meant(folder, entry):
    cls = Pipeline
    with pytest.raises(UnknownKeywordError, match=r"unknown keyword 'max_mem' \(did you mean max_memory\?\)") as caught:
        getattr(cls, entry)(folder, max_mem={0: "1GiB"})
    assert "has no component" not in str(caught.value)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, pipelines.LoadError)


def test_a_keyword_close_to_nothing_lists_the_arguments_and_the_components(folder):
    with pytest.raises(UnknownKeywordError, match=r"unknown keyword 'zzz': its arguments are .*max_memory.*"
                                                  r"components \(passed in by name\) are \[.*'vae'"):
        Pipeline.from_pretrained(folder, zzz=1)


def test_a_misspelt_component_is_suggested_too(folder):
    with pytest.raises(UnknownKeywordError, match=r"'text_encodr' \(did you mean text_encoder\?\)"):
        Pipeline.from_pretrained(folder, text_encodr=None)


def test_a_keyword_that_is_a_component_passes_the_component(folder):
    vae = Pipeline.from_pretrained(folder, progress=False).vae
    pipe = Pipeline.from_pretrained(folder, vae=vae, progress=False)
    assert pipe.vae is vae


def test_diffusers_loading_keywords_that_ask_for_what_we_do_are_accepted(folder, caplog):
    with caplog.at_level("INFO", logger="pipelines.hf.loading_keywords"):
        pipe = Pipeline.from_pretrained(folder, low_cpu_mem_usage=True, offload_state_dict=True,
                                                   use_onnx=False, progress=False)
    assert pipe.vae is not None
    assert "low_cpu_mem_usage=True): accepted and not needed: every load here builds the model on meta" in caplog.text
    plan = Pipeline.plan_placement(folder, use_safetensors=True, low_cpu_mem_usage=True,
                                              max_memory={0: "1GiB"})
    assert plan.accelerators == [0]
    transformer = pipelines.load_model(folder / "transformer", device_map=None, low_cpu_mem_usage=True,
                                       local_files_only=True, revision="main")
    assert type(transformer).__name__ == "FluxTransformer2DModel"
    text_encoder = pipelines.load_model(folder / "text_encoder", low_cpu_mem_usage=True, progress=False)
    assert type(text_encoder).__name__ == "CLIPTextModel"


@pytest.mark.parametrize("keyword, value, reason", [
    ("low_cpu_mem_usage", False, "builds the model on meta"),
    ("provider_options", {"device_id": 0}, "ONNX Runtime"),
    ("provider", "CUDAExecutionProvider", "ONNX Runtime"),
    ("use_onnx", True, "ONNX Runtime"),
    ("custom_pipeline", "lpw_stable_diffusion", r"never downloads and runs pipeline code.*pipelines.place"),
    ("from_flax", True, "Flax weights are not read"),
    ("ignore_mismatched_sizes", True, "CheckpointShapeError"),
])
def test_diffusers_loading_keywords_we_cannot_honour_are_refused_by_name(folder, keyword, value, reason):
    with pytest.raises(LoadError, match=rf"from_pretrained\({keyword}=.*\) is not supported: .*{reason}"):
        Pipeline.from_pretrained(folder, **{keyword: value})
    with pytest.raises(LoadError, match=rf"\({keyword}=.*{reason}"):
        pipelines.load_model(folder / "transformer", **{keyword: value})


def test_model_entries_and_place_name_the_argument_meant(folder):
    with pytest.raises(UnknownKeywordError, match=r"load_model: unknown keyword 'max_mem' \(did you mean max_memory\?\)"):
        pipelines.load_model(folder / "text_encoder", max_mem={0: "1GiB"})
    with pytest.raises(UnknownKeywordError, match=r"plan_model: .*'devce_map' \(did you mean device_map"):
        pipelines.plan_model(folder / "text_encoder", devce_map="auto")
    with pytest.raises(UnknownKeywordError, match=r"load_model: unknown keyword 'torch_dtyp' \(did you mean torch_dtype"):
        pipelines.load_model(folder / "transformer", torch_dtyp=None)
    with pytest.raises(UnknownKeywordError, match=r"plan_model: unknown keyword 'max_mem'"):
        pipelines.plan_model(folder / "transformer", max_mem={0: "1GiB"})
    pipe = Pipeline.from_pretrained(folder, progress=False)
    with pytest.raises(UnknownKeywordError, match=r"pipelines.place: unknown keyword 'max_mem' \(did you mean max_memory"):
        pipelines.place(pipe, max_mem={0: "1GiB"})
    assert getattr(pipe, "hf_device_map", None) is None  # refused before anything moved
