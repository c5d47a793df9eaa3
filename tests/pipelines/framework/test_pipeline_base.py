"""Pipeline without placement: components, the model graph's order, save/load of the folder format, errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hooks.errors import OffloadConflictError
from pipelines import Pipeline, UnknownKeywordError
from pipelines.checkpoint import CheckpointSaveError
from pipelines.errors import FolderError
from pipelines.text_to_image.schedulers import FlowMatchEulerScheduler

from own_fixtures import USER_IDS, Decoder, DecoderConfig, TinyUserPipeline, tiny_user_pipeline
from same_output import assert_same_output


class Diamond(Pipeline):
    model_graph = [("a", "c"), ("b", "c"), ("c", "d"), ("extra", "c")]

    def __init__(self, a, b, c, d, extra=None, tokenizer=None):
        super().__init__()
        self.register_components(d=d, c=c, b=b, a=a, extra=extra, tokenizer=tokenizer)


def linear():
    return nn.Linear(2, 2)


def test_components_and_execution_order_follow_the_graph():
    pipe = Diamond(linear(), linear(), linear(), linear(), tokenizer="tok")
    assert list(pipe.components) == ["d", "c", "b", "a", "extra", "tokenizer"]
    assert pipe.components["extra"] is None and pipe.components["tokenizer"] == "tok"
    # Topological; ties in registration order (b registered before a); the absent optional one dropped.
    assert pipe.execution_order == ["b", "a", "c", "d"]
    assert list(pipe.module_components) == pipe.execution_order
    assert pipe.graph_edges == [("a", "c"), ("b", "c"), ("c", "d")]
    assert pipe.hf_device_map is None and pipe.device == torch.device("cpu")


def test_reassigned_component_is_what_components_returns():
    pipe = Diamond(linear(), linear(), linear(), linear())
    replacement = linear()
    pipe.c = replacement
    assert pipe.components["c"] is replacement


def test_graph_naming_an_unknown_component_or_with_a_cycle_is_an_error():
    class Typo(Pipeline):
        model_graph = [("encoder", "denoisr")]

        def __init__(self):
            super().__init__()
            self.register_components(encoder=linear(), denoiser=linear())

    with pytest.raises(FolderError, match="denoisr"):
        Typo().execution_order

    class Cycle(Pipeline):
        model_graph = [("a", "b"), ("b", "a")]

        def __init__(self):
            super().__init__()
            self.register_components(a=linear(), b=linear())

    with pytest.raises(FolderError, match="cycle"):
        Cycle().execution_order


def test_to_moves_and_casts_every_module_when_not_device_mapped():
    pipe = tiny_user_pipeline()
    assert pipe.to(torch.float64) is pipe
    assert {p.dtype for m in pipe.module_components.values() for p in m.parameters()} == {torch.float64}
    pipe.to("cpu", dtype=torch.float32)
    assert pipe.dtype == torch.float32


def test_guard_refuses_to_on_a_device_mapped_pipeline():
    pipe = tiny_user_pipeline()
    pipe.hf_device_map = {"encoder": "cpu"}
    with pytest.raises(OffloadConflictError, match="reset_device_map"):
        pipe.to(torch.float16)


def test_user_pipeline_round_trip_without_device_map(tmp_path):
    pipe = tiny_user_pipeline()
    pipe.register_components(scheduler=FlowMatchEulerScheduler(shift=2.0))
    expected = pipe(USER_IDS)
    pipe.save_pretrained(tmp_path / "user")
    index = json.loads((tmp_path / "user" / "model_index.json").read_text())
    assert index["_class_name"] == "TinyUserPipeline"
    assert index["encoder"] == ["own_fixtures", "Encoder"]
    assert index["scheduler"] == ["pipelines", "FlowMatchEulerScheduler"]
    assert index["_model_graph"] == [["encoder", "denoiser"], ["denoiser", "decoder"]]

    loaded = TinyUserPipeline.from_pretrained(tmp_path / "user")
    assert type(loaded) is TinyUserPipeline and loaded.hf_device_map is None
    assert loaded.scheduler.config.shift == 2.0
    assert_same_output(loaded(USER_IDS), expected)


def test_base_class_loads_any_folder_as_a_generic_pipeline(tmp_path):
    pipe = tiny_user_pipeline()
    pipe.save_pretrained(tmp_path / "user")
    generic = Pipeline.from_pretrained(tmp_path / "user")
    assert type(generic) is Pipeline
    assert generic.execution_order == ["encoder", "denoiser", "decoder"]
    assert generic.scheduler is None  # saved as [null, null]
    assert torch.equal(generic.decoder.proj.weight, pipe.decoder.proj.weight)  # read back: exact


def test_save_is_atomic_a_failing_component_leaves_the_old_folder(tmp_path):
    target = tmp_path / "user"
    tiny_user_pipeline(seed=0).save_pretrained(target)
    before = sorted(p.relative_to(target) for p in target.rglob("*"))

    class Unsaveable:
        def save_pretrained(self, folder):
            raise OSError("disk full")

    broken = tiny_user_pipeline(seed=1)
    broken.register_components(scheduler=Unsaveable())
    with pytest.raises(CheckpointSaveError, match="disk full"):
        broken.save_pretrained(target)
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["user"]  # no staging folder left behind
    reloaded = TinyUserPipeline.from_pretrained(target)
    assert_same_output(reloaded(USER_IDS), tiny_user_pipeline(seed=0)(USER_IDS))


def test_missing_component_folder_is_an_error_naming_it(tmp_path):
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    for path in (tmp_path / "user" / "decoder").iterdir():
        path.unlink()
    (tmp_path / "user" / "decoder").rmdir()
    with pytest.raises(FolderError, match="'decoder'.*missing"):
        TinyUserPipeline.from_pretrained(tmp_path / "user")
    # Passing the missing component in instead is fine.
    loaded = TinyUserPipeline.from_pretrained(tmp_path / "user", decoder=Decoder(DecoderConfig()))
    assert loaded(USER_IDS).shape == (2, 3)


def test_required_component_absent_from_the_index_is_an_error(tmp_path):
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    index_path = tmp_path / "user" / "model_index.json"
    index = json.loads(index_path.read_text())
    del index["denoiser"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(FolderError, match=r"needs component\(s\) \['denoiser'\]"):
        TinyUserPipeline.from_pretrained(tmp_path / "user")


@pytest.mark.parametrize(
    "entry, message",
    [
        (["pipelines", "NoSuchModel"], "not part of the 'pipelines' library"),
        (["no_such_library_xyz", "Decoder"], "module 'no_such_library_xyz'.*trust_remote_code=True"),
        (["own_fixtures", "NoSuchClass"], "class 'NoSuchClass' in module 'own_fixtures'.*register_class"),
        (["pipelines", "Decoder", "extra"], r"expected \[library, ClassName\]"),
    ],
)
def test_unknown_library_or_class_is_a_clear_error(tmp_path, entry, message):
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    index_path = tmp_path / "user" / "model_index.json"
    index = json.loads(index_path.read_text())
    index["decoder"] = entry
    index_path.write_text(json.dumps(index))
    with pytest.raises(FolderError, match=message):
        TinyUserPipeline.from_pretrained(tmp_path / "user")


def test_folder_without_model_index_is_an_error(tmp_path):
    with pytest.raises(FolderError, match="model_index.json"):
        Pipeline.from_pretrained(tmp_path)


def test_passing_a_component_the_pipeline_does_not_have_is_an_error(tmp_path):
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    with pytest.raises(UnknownKeywordError, match=r"unknown keyword 'vae': .*components \(passed in by name\) are "
                                                  r"\['decoder', 'denoiser', 'encoder', 'scheduler'\]"):
        TinyUserPipeline.from_pretrained(tmp_path / "user", vae=linear())


def test_generic_load_refuses_a_misspelt_keyword_instead_of_adding_a_component(tmp_path):
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    with pytest.raises(UnknownKeywordError, match=r"unknown keyword 'device_mp' \(did you mean device_map\?\)"):
        Pipeline.from_pretrained(tmp_path / "user", device_mp="balanced")


def test_a_passed_non_module_where_the_folder_holds_a_model_is_an_error(tmp_path):
    """denoiser="path/to/denoiser" used to be accepted and fail at the first call; a module of another class
    (a wrapped or quantized model) and None stay allowed."""
    tiny_user_pipeline().save_pretrained(tmp_path / "user")
    for cls in (TinyUserPipeline, Pipeline):
        with pytest.raises(FolderError, match=r"decoder=\.\.\.\) got a str, but 'decoder' is a model "
                                                         r"in this folder \(own_fixtures.Decoder\)"):
            cls.from_pretrained(tmp_path / "user", decoder="decoder/")
    other = nn.Linear(8, 3)
    assert TinyUserPipeline.from_pretrained(tmp_path / "user", decoder=other).decoder is other
    assert Pipeline.from_pretrained(tmp_path / "user", decoder=None).decoder is None
