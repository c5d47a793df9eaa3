"""One set of load options (`pipelines.loading.request.LoadOptions`), each keyword written once: the entries'
signatures and the arguments a misspelt keyword is matched against are made from its fields, every field is read
by the loader, and `plan_placement(folder, **kw)` is the plan `from_pretrained(folder, **kw)` follows, compared
as JSON on option sets that take each planning path (strategies, budgets with integer GPU keys and "cpu", dtypes,
disk, a call= size, VAE techniques, a diffusers class), loaded on two strict virtual accelerators."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import pipelines
import placement.budgets as budgets
from pipelines import ModelMixin, Pipeline, TextToImagePipeline, UnknownKeywordError
from pipelines.loading.request import (
    MODEL_LOAD, MODEL_PLAN, PIPELINE_ARGUMENTS, PIPELINE_LOAD, PIPELINE_PLAN, LoadOptions, Scope, arguments_of,
)

from checkpoint_models import TinyModel, tiny_model
from pipeline_fixtures import save_preset
from test_virtual_accelerators import EVERY_KIND_STRATEGY, every_kind

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
PACKAGE = Path(pipelines.__file__).parent
# Per GPU, with a call's 1 GiB runtime overhead: 30% of tiny-flux's weights, where a text encoder no longer fits
# whole (split) and the other is offloaded (T5's prompt cut to 16 tokens, or its activations would fill the GPUs);
# and tiny SD's VAE decodes tiled at 256x256.
TIGHT_FRACTION = 0.3
TIGHT_CALL = {"height": 64, "width": 64, "max_sequence_length": 16}
TILED = 2**30 + 4000 * 2**10


def tight(folder) -> int:
    plan = Pipeline.plan_placement(folder, max_memory={0: "8GiB", "cpu": "8GiB"})
    return 2**30 + int(TIGHT_FRACTION * sum(component.bytes for component in plan.components.values()))


def keyword_names(entry) -> list[str]:
    return [name for name, p in inspect.signature(entry).parameters.items() if p.kind is p.KEYWORD_ONLY]


@pytest.mark.parametrize(("load", "plan", "scope"), [
    (Pipeline.from_pretrained, Pipeline.plan_placement, Scope.PIPELINE),
    (TextToImagePipeline.from_pretrained, TextToImagePipeline.plan_placement, Scope.PIPELINE),
    (ModelMixin.from_pretrained, ModelMixin.plan_placement, Scope.MODEL),
    (TinyModel.from_pretrained, TinyModel.plan_placement, Scope.MODEL),
])
def test_both_entries_of_a_scope_take_exactly_the_options_of_that_scope(load, plan, scope):
    assert keyword_names(load) == keyword_names(plan) == list(arguments_of(scope))
    fields = {f.name: f for f in dataclasses.fields(LoadOptions)}
    defaults = {name: p.default for name, p in inspect.signature(load).parameters.items() if name in fields}
    assert defaults["device_map"] is None and defaults["max_memory"] is None and defaults["progress"] is True
    assert inspect.signature(plan).parameters["device_map"].default == (
        "balanced" if scope is Scope.PIPELINE else "auto")


def test_every_option_is_taken_by_some_entry_and_read_by_the_loader():
    sources = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    for option in dataclasses.fields(LoadOptions):
        assert option.metadata["takes"], option.name
        if option.name == "dtype":  # folded into torch_dtype as the options are made
            continue
        assert re.search(rf"options\.{option.name}\b", sources), f"no code reads LoadOptions.{option.name}"
    assert set(PIPELINE_ARGUMENTS) == set(arguments_of(Scope.PIPELINE))


def test_a_keyword_is_validated_once_with_the_same_words_at_every_entry():
    assert LoadOptions(dtype=torch.float16).torch_dtype is torch.float16
    assert LoadOptions(pin=["vae"]).pin == ("vae",)
    with pytest.raises(pipelines.LoadError, match="torch_dtype=torch.float32 and dtype=torch.float16"):
        LoadOptions(torch_dtype=torch.float32, dtype=torch.float16)
    options, rest = LoadOptions.take({"max_memory": {0: "1GiB"}, "vae": None, "low_cpu_mem_usage": True},
                                     entry=PIPELINE_PLAN, label="P.plan_placement")
    assert options.device_map == "balanced" and options.max_memory == {0: "1GiB"} and rest == {"vae": None}
    assert LoadOptions.take({}, entry=PIPELINE_LOAD, label="P.from_pretrained")[0].device_map is None
    assert LoadOptions.take({}, entry=MODEL_PLAN, label="M.plan_placement")[0].device_map == "auto"
    with pytest.raises(UnknownKeywordError, match=r"M.from_pretrained: unknown keyword 'max_mem' \(did you mean "
                                                  r"max_memory\?\)"):
        LoadOptions.take({"max_mem": 1}, entry=MODEL_LOAD, label="M.from_pretrained")
    with pytest.raises(UnknownKeywordError, match=r"unknown keyword 'call'"):  # a model has no call to plan for
        LoadOptions.take({"call": {}}, entry=MODEL_LOAD, label="M.from_pretrained")


# ---- plan_placement(**kw) == from_pretrained(**kw).placement_plan ------------------------------------------------

@pytest.fixture
def strict_two_gpus(monkeypatch):
    """Two strict virtual GPUs, and a fixed available RAM: a detected "cpu" budget is read anew by each entry
    (the machine's free RAM moves between two calls), which is not what is compared here."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")
    monkeypatch.setattr(budgets, "_available_ram", lambda: 16 * 2**30)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("options") / "tiny-flux")[0]


def assert_loaded_as_planned(cls, folder, **keywords):
    planned = cls.plan_placement(folder, **keywords)
    loaded = cls.from_pretrained(folder, progress=False, **keywords)
    followed = loaded.placement_plan
    if any(c.placed_bytes.get("disk") for c in planned.components.values()):
        # The load measures the read speed of the drive it serves "disk" from (planning alone reads no weights):
        # the same placement, with this machine's figure for its seconds.
        assert followed.disk_read_bandwidth_source.startswith("measured: ")
        followed = followed.model_copy(update={"disk_read_bandwidth": planned.disk_read_bandwidth,
                                               "disk_read_bandwidth_source": planned.disk_read_bandwidth_source})
    try:
        assert followed.to_json() == planned.to_json()
    finally:
        loaded.reset_device_map() if hasattr(loaded, "reset_device_map") else None
    return planned


@pytest.mark.parametrize("keywords", [
    dict(device_map="balanced"),
    dict(device_map="auto", torch_dtype=torch.bfloat16, max_memory={0: "1GiB", 1: "1GiB", "cpu": "4GiB"}),
    dict(device_map={"vae": 1}, torch_dtype={"transformer": torch.float16, "default": torch.float32}),
    dict(device_map="balanced", max_memory="tight", call=TIGHT_CALL),
], ids=["balanced", "auto-bf16-budgets", "pins-dtype-dict", "call-size-tight"])
def test_a_pipeline_loads_the_plan_plan_placement_gives(strict_two_gpus, preset, keywords):
    if keywords.get("max_memory") == "tight":
        keywords = {**keywords, "max_memory": {0: tight(preset), 1: tight(preset), "cpu": "8GiB"}}
    plan = assert_loaded_as_planned(Pipeline, preset, **keywords)
    if "call" in keywords:  # the budget was chosen so that the plan splits one component and offloads others
        assert {"split", "offloaded"} <= {component.kind.value for component in plan.components.values()}


def test_the_plan_with_every_kind_disk_included_is_the_one_loaded(strict_two_gpus, preset, tmp_path):
    plan = assert_loaded_as_planned(Pipeline, preset, device_map=EVERY_KIND_STRATEGY, max_memory=every_kind(preset),
                                    offload_folder=tmp_path / "offload")
    assert "disk" in plan.device_map.values()


def test_plan_placement_without_device_map_is_the_default_strategy_loaded(strict_two_gpus, preset):
    assert Pipeline.plan_placement(preset).to_json() == Pipeline.from_pretrained(
        preset, device_map="balanced", progress=False).placement_plan.to_json()


@pytest.mark.parametrize("keywords", [
    dict(device_map="auto", max_memory={0: "20KiB", 1: "20KiB", "cpu": "1GiB"}),
    dict(device_map="sequential", max_memory={0: "12KiB", 1: "1GiB"}, torch_dtype=torch.float16),
    dict(device_map="balanced_low_0", dtype="bfloat16"),
], ids=["auto-split", "sequential-fp16", "low0-dtype-spelling"])
def test_a_model_loads_the_plan_plan_placement_gives(strict_two_gpus, tmp_path, keywords):
    tiny_model().save_pretrained(tmp_path / "model")
    assert_loaded_as_planned(TinyModel, tmp_path / "model", **keywords)


def test_a_diffusers_class_with_a_call_loads_the_plan_plan_placement_gives(strict_two_gpus, tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from test_diffusers_pipelines import build_sd

    build_sd(tmp_path).save_pretrained(tmp_path / "sd")
    plan = assert_loaded_as_planned(Pipeline, tmp_path / "sd", device_map="balanced", torch_dtype=torch.float32,
                                    max_memory={0: TILED, 1: TILED, "cpu": "8GiB"}, call={"height": 256, "width": 256})
    assert [t.technique.value for t in plan.components["vae"].memory_techniques] == ["vae_tiling"]


def test_both_entries_plan_through_the_one_function_with_equal_options(strict_two_gpus, preset, tmp_path,
                                                                       monkeypatch):
    """By construction, not by luck: each entry pair calls one planning function once, with equal options (a
    pipeline's VAE techniques and formats are chosen inside its one placement.plan call, so neither entry can
    re-plan apart)."""
    import pipelines.loading.single_model as single_model
    import pipelines.loading.pipeline_loader as pipeline_loader

    budget = tight(preset)  # planned before the planning functions are watched
    seen = []
    for module, name in ((pipeline_loader, "plan_components"), (single_model, "_plan_own")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _original=original, **k: seen.append(
            (_original.__name__, _request_of(a, k).options)) or _original(*a, **k))
    keywords = dict(device_map="balanced", max_memory={0: budget, 1: budget, "cpu": "8GiB"}, call=TIGHT_CALL,
                    progress=False)
    Pipeline.plan_placement(preset, **keywords)
    Pipeline.from_pretrained(preset, **keywords).reset_device_map()
    tiny_model().save_pretrained(tmp_path / "model")
    TinyModel.plan_placement(tmp_path / "model", device_map="auto", offload_folder=tmp_path, progress=False)
    TinyModel.from_pretrained(tmp_path / "model", device_map="auto", offload_folder=tmp_path, progress=False)
    (pipe_plan, pipe_load, model_plan, model_load) = seen
    assert pipe_plan == pipe_load and pipe_plan[0] == "plan_components"
    assert model_plan == model_load and model_plan[0] == "_plan_own"


def _request_of(args, kwargs):
    from pipelines.loading.request import LoadRequest

    return next(value for value in [*args, *kwargs.values()] if isinstance(value, LoadRequest))


def test_an_entry_cannot_declare_a_keyword_of_its_own_beside_the_options():
    from pipelines.loading.request import entry_signature

    def from_pretrained(cls, pretrained, *, fast=False, **keywords):
        return None

    with pytest.raises(TypeError, match="must take \\(cls, pretrained, \\*\\*keywords\\)"):
        entry_signature(PIPELINE_LOAD)(from_pretrained)


def test_the_other_entries_spell_their_keywords_as_the_options_do():
    """`pipelines.load_model` / `plan_model` / `place` keep signatures of their own (a model file's
    `layerwise_casting` is one dtype, `hub=` a HubOptions); each keyword they take is still an option's name."""
    fields = {option.name for option in dataclasses.fields(LoadOptions)}
    for entry in (pipelines.load_model, pipelines.plan_model, pipelines.place):
        assert set(keyword_names(entry)) - {"hub"} <= fields, entry.__name__
