"""A local folder missing the weights its index, its other components or its save say it has is refused by the plan
as by the load (`WeightsNotFoundError` naming the component and the file; `placement plan` and `placement run` exit
2 with it before any verdict): a plan is made for the load, which cannot happen. A folder without any weights is
planned from its configs, as documented: without a word, or, for a folder this library saved, with a note per
component (a configs-only copy of it, or weights all gone)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

import pipelines
from pipelines import Pipeline
from pipelines.checkpoint import WeightsNotFoundError
from pipelines.cli import main
from pipelines.folder.model_index import SAVE_ID_KEY

from pipeline_fixtures import save_preset

BUDGETS = {0: "1GiB", "cpu": "1GiB"}
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("missing") / "tiny-flux")[0]


@pytest.fixture
def folder(saved, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(saved, copy)
    return copy


def missing_notes(plan):
    return [note for note in plan.warnings if "loading it will fail until its weights are there" in note]


def test_a_deleted_weights_file_is_an_error_on_the_plan_as_on_the_load(folder):
    (folder / "transformer" / WEIGHTS).unlink()
    with pytest.raises(WeightsNotFoundError) as refused:
        Pipeline.plan_placement(folder, max_memory=BUDGETS)
    said = str(refused.value)
    assert said.startswith("This folder cannot load as it is: a component's weights are missing. transformer: "
                           f"No weights in {str(folder / 'transformer')!r}: expected {WEIGHTS!r}"), said
    with pytest.raises(WeightsNotFoundError, match=f"No weights in '{folder / 'transformer'}'"):
        Pipeline.from_pretrained(folder, device_map="balanced", max_memory=BUDGETS, progress=False)


def test_every_missing_component_is_named_at_once(folder):
    (folder / "transformer" / WEIGHTS).unlink()
    (folder / "vae" / WEIGHTS).unlink()
    with pytest.raises(WeightsNotFoundError, match="2 components' weights are missing") as refused:
        pipelines.Pipeline.plan_placement(folder, max_memory=BUDGETS)
    assert "transformer: No weights in" in str(refused.value) and "vae: No weights in" in str(refused.value)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_the_commands_refuse_it_before_any_verdict(folder, tmp_path, command):
    (folder / "vae" / WEIGHTS).unlink()
    (tmp_path / "prompts.txt").write_text("a lighthouse\n")
    extra = ["--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "images")] if command == "run" else []
    output, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(errors):
        code = main([command, str(folder), "--max-memory", "cpu=1GiB", *extra])
    assert code == 2 and "Verdict" not in output.getvalue(), output.getvalue()
    assert f"placement {command}: error: This folder cannot load as it is" in errors.getvalue()
    assert f"vae: No weights in {str(folder / 'vae')!r}" in errors.getvalue()
    assert not (tmp_path / "images").exists()


def test_a_configs_only_folder_is_planned_without_a_word(folder):
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    index = json.loads((folder / "model_index.json").read_text())
    index.pop(SAVE_ID_KEY, None)  # not a save of this library: configs written to plan from
    (folder / "model_index.json").write_text(json.dumps(index))
    assert missing_notes(Pipeline.plan_placement(folder, max_memory=BUDGETS)) == []


def test_a_saved_folder_without_any_weights_is_planned_with_a_note_per_component(folder):
    """A folder this library saved carries its save id in model_index.json: its weights are expected."""
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, SAVE_ID_KEY: "0" * 32}))
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    notes = missing_notes(Pipeline.plan_placement(folder, max_memory=BUDGETS))
    assert [note.partition(":")[0] for note in notes] == ["text_encoder", "text_encoder_2", "transformer", "vae"]


def test_a_shard_missing_from_its_index_is_named_on_a_model_plan(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4).save_pretrained(
        tmp_path / "model", max_shard_size="20KB")
    shard = sorted((tmp_path / "model").glob("*-of-*"))[0]
    shard.unlink()
    for entry in (pipelines.plan_model, pipelines.load_model):
        with pytest.raises(WeightsNotFoundError, match=shard.name):
            entry(tmp_path / "model", max_memory=BUDGETS, **({} if entry is pipelines.plan_model else {"progress": False}))
