"""Hub ids resolve through snapshot_download limited to the needed files; local paths never touch it."""

from __future__ import annotations

import fnmatch
from pathlib import Path
import shutil

import pytest
import torch

import pipelines.folder.sources as hub
from pipelines.checkpoint import WeightsNotFoundError

from checkpoint_models import TinyModel, tiny_model
from pipelines import TextToImagePipeline


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A repository with two components and two variants; snapshot_download copies what the patterns allow."""
    repo = tmp_path / "repo"
    tiny_model().save_pretrained(repo / "denoiser")
    tiny_model().to(torch.float16).save_pretrained(repo / "denoiser", variant="fp16", max_shard_size=3000)
    tiny_model(seed=3).save_pretrained(repo / "other")
    calls = []

    def snapshot_download(repo_id, *, allow_patterns=None, revision=None):
        calls.append((repo_id, list(allow_patterns or [])))
        snapshot = tmp_path / "snapshot"
        for path in repo.rglob("*"):
            relative = path.relative_to(repo).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(relative, p) for p in allow_patterns or ["*"]):
                (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, snapshot / relative)
        return str(snapshot)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", snapshot_download)
    return calls, tmp_path / "snapshot"


def test_hub_id_downloads_only_the_requested_variant_of_the_subfolder(fake_hub):
    calls, snapshot = fake_hub
    model = TinyModel.from_pretrained("org/tiny", subfolder="denoiser", variant="fp16", progress=False)
    assert calls[0][0] == "org/tiny"
    fetched = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    shards = [f for f in fetched if f.startswith("denoiser/diffusion_pytorch_model.fp16-")]
    assert len(shards) > 1
    assert fetched == sorted(
        ["denoiser/config.json", "denoiser/diffusion_pytorch_model.safetensors.index.fp16.json", *shards]
    )
    expected = tiny_model().to(torch.float16)
    assert torch.equal(model.blocks[1].fc1.weight, expected.blocks[1].fc1.weight)


def test_local_folder_never_calls_the_hub(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network used for a local folder")

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", refuse)
    tiny_model().save_pretrained(tmp_path / "local")
    assert hub.resolve_folder(tmp_path / "local") == tmp_path / "local"


def test_neither_folder_nor_hub_id_is_a_clear_error(tmp_path):
    with pytest.raises(hub.WeightsNotFoundError, match=r"No such folder: .*place'"):
        hub.resolve_folder(str(tmp_path / "no" / "such" / "place"))


@pytest.mark.parametrize("spelled", ["./my-pipe", "my-pipe/", "../x/my-pipe", "~/no-such-pipe-here", "a/b/c",
                                     "my pipe", "C:\\pipes\\x"])
def test_a_missing_path_is_no_such_folder_not_the_hub_rules(tmp_path, monkeypatch, spelled):
    """A path (or a name no Hub id can have) that does not exist is reported as a missing folder: never through
    huggingface_hub's repo-id rules ("Repo id must use alphanumeric chars...") and never a download attempt."""
    def refuse(*args, **kwargs):
        raise AssertionError("network used for a path")

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", refuse)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hub.WeightsNotFoundError, match=r"^No such folder: .*\(looked for .*Check the path") as caught:
        TextToImagePipeline.from_pretrained(spelled)
    assert "Repo id" not in str(caught.value) and isinstance(caught.value, WeightsNotFoundError)
    with pytest.raises(hub.WeightsNotFoundError, match="No such folder"):
        TinyModel.plan_placement(Path(spelled))


def test_missing_subfolder_is_named(tmp_path):
    tiny_model().save_pretrained(tmp_path / "m")
    with pytest.raises(WeightsNotFoundError, match="unet"):
        hub.resolve_folder(tmp_path / "m", subfolder="unet")


def test_a_failed_download_names_the_path_it_looked_for_and_what_to_check(tmp_path, monkeypatch):
    """A mistyped local folder ("nope") is a valid Hub id: the download's own error (offline here) spoke of
    snapshots and connections only."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.")

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsNotFoundError, match=r"'nope' is not an existing folder \(looked for .*nope'\).*"
                                                   r"LocalEntryNotFoundError.*Check the path") as caught:
        TinyModel.from_pretrained("nope")
    assert isinstance(caught.value.__cause__, LocalEntryNotFoundError)
