"""A local folder missing the weights its index or its other components say it has is planned with a warning
naming the component and the file (in `plan.warnings`, `explain()` and `placement plan`'s output), and its load
fails as before; a configs-only folder is planned without a word, as documented."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

import pipelines
from pipelines import TextToImagePipeline
from pipelines.checkpoint import WeightsNotFoundError
from pipelines.cli import main
from pipelines.folder.model_index import SAVE_ID_KEY

from pipeline_fixtures import save_preset

BUDGETS = {0: "1GiB", "cpu": "1GiB"}
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("missing") / "tiny-dit")[0]


@pytest.fixture
def folder(saved, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(saved, copy)
    return copy


def missing_notes(plan):
    return [note for note in plan.warnings if "loading it will fail until its weights are there" in note]


def test_a_deleted_weights_file_is_a_warning_on_the_plan_and_an_error_on_load(folder):
    (folder / "denoiser" / WEIGHTS).unlink()
    plan = TextToImagePipeline.plan_placement(folder, max_memory=BUDGETS)
    [note] = missing_notes(plan)
    assert note.startswith("denoiser: No weights in") and WEIGHTS in note
    assert note in plan.explain()
    with pytest.raises(WeightsNotFoundError, match="denoiser"):
        TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory=BUDGETS, progress=False)


def test_the_command_shows_the_warning_and_still_plans(folder):
    (folder / "vae" / WEIGHTS).unlink()
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", str(folder), "--max-memory", "0=1GiB,cpu=1GiB"])
    assert code == 0 and "vae: No weights in" in output.getvalue()


def test_a_configs_only_folder_is_planned_without_a_word(folder):
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    index = json.loads((folder / "model_index.json").read_text())
    index.pop(SAVE_ID_KEY, None)  # not a save of this library: configs written to plan from
    (folder / "model_index.json").write_text(json.dumps(index))
    assert missing_notes(TextToImagePipeline.plan_placement(folder, max_memory=BUDGETS)) == []


def test_a_shard_missing_from_its_index_is_named_on_a_model_plan(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4).save_pretrained(
        tmp_path / "model", max_shard_size="20KB")
    shard = sorted((tmp_path / "model").glob("*-of-*"))[0]
    shard.unlink()
    [note] = missing_notes(pipelines.plan_model(tmp_path / "model", max_memory=BUDGETS))
    assert shard.name in note
    with pytest.raises(WeightsNotFoundError, match=shard.name):
        pipelines.load_model(tmp_path / "model", max_memory=BUDGETS, progress=False)
