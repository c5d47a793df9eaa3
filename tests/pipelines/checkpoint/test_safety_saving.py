"""Saving never destroys what it did not write (issue 12): one atomic save for models and pipelines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from own_fixtures import TinyUserPipeline, tiny_user_pipeline

from pipelines.checkpoint import CheckpointSaveError, saving as atomic, saving as weights_saving


def _hidden_entries(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_pipeline_save_keeps_unrelated_files_in_the_target(tmp_path):
    target = tmp_path / "pipe"
    (target / "data").mkdir(parents=True)
    (target / "README.md").write_text("my notes")
    (target / "train.py").write_text("print('train')")
    (target / "data" / "set.csv").write_text("1,2")
    tiny_user_pipeline(seed=0).save_pretrained(target)
    assert (target / "README.md").read_text() == "my notes"
    assert (target / "train.py").read_text() == "print('train')"
    assert (target / "data" / "set.csv").read_text() == "1,2"
    assert (target / "model_index.json").is_file() and _hidden_entries(tmp_path) == []


def test_saving_a_variant_keeps_the_default_weights_loadable(tmp_path):
    target = tmp_path / "pipe"
    original = tiny_user_pipeline(seed=0)
    original.save_pretrained(target)
    tiny_user_pipeline(seed=1).save_pretrained(target, variant="fp16")
    default = TinyUserPipeline.from_pretrained(target)
    fp16 = TinyUserPipeline.from_pretrained(target, variant="fp16")
    for name, module in original.module_components.items():
        assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(),
                                                    default.components[name].state_dict().values()))
    assert not torch.equal(default.denoiser.blocks[0].linear.weight, fp16.denoiser.blocks[0].linear.weight)


def test_resaving_sharded_as_single_file_drops_the_old_shards(tmp_path):
    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target, max_shard_size=200)
    assert any("-of-" in p.name for p in (target / "denoiser").iterdir())
    fresh = tiny_user_pipeline(seed=3)
    fresh.save_pretrained(target)
    names = sorted(p.name for p in (target / "denoiser").iterdir())
    assert names == ["config.json", "diffusion_pytorch_model.safetensors"]
    loaded = TinyUserPipeline.from_pretrained(target)
    assert torch.equal(loaded.denoiser.blocks[0].linear.weight, fresh.denoiser.blocks[0].linear.weight)


def test_a_regular_file_target_is_refused_for_pipelines_and_models(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    pipe = tiny_user_pipeline()
    with pytest.raises(CheckpointSaveError, match="not a folder"):
        pipe.save_pretrained(target)
    with pytest.raises(CheckpointSaveError, match="not a folder"):
        pipe.encoder.save_pretrained(target)
    assert target.read_text() == "keep me" and _hidden_entries(tmp_path) == []


def test_the_working_folder_and_its_parents_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "project" / "run"
    work.mkdir(parents=True)
    (work / "train.py").write_text("x")
    monkeypatch.chdir(work)
    pipe = tiny_user_pipeline()
    for target in (".", str(work), str(work.parent)):
        with pytest.raises(CheckpointSaveError, match="current working folder"):
            pipe.encoder.save_pretrained(target)
        with pytest.raises(CheckpointSaveError, match="current working folder"):
            pipe.save_pretrained(target)
    assert os.getcwd() == str(work) and (work / "train.py").read_text() == "x"


def test_full_disk_during_save_is_a_save_error_and_leaves_everything_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights_saving, "save_file", full_disk)
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        tiny_user_pipeline(seed=1).save_pretrained(target)
    after = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after == before and _hidden_entries(tmp_path) == []


def test_the_safetensors_writers_own_full_disk_error_is_a_save_error_too(tmp_path, monkeypatch):
    """safetensors' Rust writer reports ENOSPC/EFBIG as its own SafetensorError, not as an OSError."""
    from safetensors import SafetensorError

    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr(weights_saving, "save_file", full_disk)
    with pytest.raises(CheckpointSaveError, match=rf"Saving to '{target}' failed: .*No space left.*unchanged"):
        tiny_user_pipeline(seed=1).save_pretrained(target)
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert _hidden_entries(tmp_path) == []


def test_a_staging_folder_left_by_a_killed_save_goes_with_the_next_save(tmp_path):
    target = tmp_path / "pipe"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".pipe.saving-{int(dead.stdout)}-0badc0de"  # kill -9 mid-save: nothing cleaned it up
    (killed / "denoiser").mkdir(parents=True)
    (killed / "denoiser" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 1000)
    running = tmp_path / f".pipe.saving-{os.getpid()}-1234abcd"  # a save still running (this process) is left alone
    running.mkdir()
    tiny_user_pipeline(seed=0).save_pretrained(target)
    assert _hidden_entries(tmp_path) == [running.name]
    TinyUserPipeline.from_pretrained(target)


@pytest.mark.parametrize("exchange_supported", [True, False])
def test_a_failing_swap_restores_the_old_folder_and_leaves_no_backup(tmp_path, monkeypatch, exchange_supported):
    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target)
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    real_rename = os.rename
    if not exchange_supported:
        monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)

    def failing_rename(source, destination):
        if ".saving-" in str(source):  # the staging folder moving into place
            raise OSError(5, "Input/output error")
        return real_rename(source, destination)

    monkeypatch.setattr(atomic.os, "rename", failing_rename)
    if exchange_supported:
        monkeypatch.setattr(atomic, "_exchange", lambda first, second: (_ for _ in ()).throw(OSError(5, "I/O")))
    with pytest.raises(CheckpointSaveError):
        tiny_user_pipeline(seed=1).save_pretrained(target)
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    assert _hidden_entries(tmp_path) == []
    TinyUserPipeline.from_pretrained(target)


def test_saving_over_a_loaded_pipeline_keeps_the_loaded_weights_valid(tmp_path):
    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target)
    loaded = TinyUserPipeline.from_pretrained(target)  # CPU tensors mapped from the files
    weight = loaded.denoiser.blocks[0].linear.weight.clone()
    tiny_user_pipeline(seed=1).save_pretrained(target)
    assert torch.equal(loaded.denoiser.blocks[0].linear.weight, weight)
