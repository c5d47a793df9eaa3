"""Folders never run code, and files stay inside their folder (issue 12)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from own_fixtures import Encoder, EncoderConfig, TinyUserPipeline, tiny_user_pipeline

import pipelines
from pipelines import Pipeline
from pipelines.checkpoint import find_weights
from pipelines.errors import FolderError, UntrustedClassError
from pipelines.folder import class_registry as registry


@pytest.fixture
def evil_folder(tmp_path, monkeypatch):
    """A pipeline folder whose model_index.json names `evilpipe.vae`, and an `evilpipe` package on sys.path
    whose import writes a marker file."""
    package = tmp_path / "site" / "evilpipe" / "vae"
    package.mkdir(parents=True)
    marker = tmp_path / "imported.marker"
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass AutoencoderKL:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["decoder"] = ["evilpipe.vae", "AutoencoderKL"]
    (folder / "model_index.json").write_text(json.dumps(index))
    yield folder, marker
    for name in [name for name in sys.modules if name.startswith("evilpipe")]:
        del sys.modules[name]


@pytest.mark.parametrize("entry_point", ["from_pretrained", "plan_placement", "from_pretrained_mapped"])
def test_a_folder_naming_an_unknown_module_imports_nothing(evil_folder, entry_point):
    folder, marker = evil_folder
    with pytest.raises(UntrustedClassError, match=r"evilpipe\.vae.*trust_remote_code=True") as error:
        if entry_point == "plan_placement":
            Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
        elif entry_point == "from_pretrained_mapped":
            Pipeline.from_pretrained(folder, device_map="cpu")
        else:
            Pipeline.from_pretrained(folder)
    assert "decoder" in str(error.value)
    assert not marker.exists() and "evilpipe" not in sys.modules


def test_trust_remote_code_is_the_explicit_opt_in(evil_folder):
    folder, marker = evil_folder
    with pytest.raises(Exception):  # the evil class is no model; what matters is that the import happened
        Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"}, trust_remote_code=True)
    assert marker.read_text() == "ran"


def test_registered_and_passed_classes_resolve_without_import(tmp_path, monkeypatch):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)  # saving registers the classes in this process
    monkeypatch.setattr(registry, "_USER_CLASSES", {})  # as a fresh process: nothing registered
    with pytest.raises(UntrustedClassError, match="register_class"):
        Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
    pipelines.register_class(Encoder)
    with pytest.raises(UntrustedClassError, match="'(denoiser|decoder)'"):
        Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
    for cls in (type(tiny_user_pipeline().denoiser), type(tiny_user_pipeline().decoder)):
        pipelines.register_class(cls)
    assert Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"}).components.keys() >= {"encoder", "denoiser"}
    monkeypatch.setattr(registry, "_USER_CLASSES", {})
    passed = tiny_user_pipeline()
    loaded = TinyUserPipeline.from_pretrained(folder, encoder=passed.encoder, denoiser=passed.denoiser,
                                              decoder=passed.decoder)
    assert loaded.encoder is passed.encoder


def test_weight_map_entries_must_be_plain_file_names(tmp_path):
    folder = tmp_path / "denoiser"
    tiny_user_pipeline().denoiser.save_pretrained(folder, max_shard_size=200)
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for bad in ("../elsewhere/x.safetensors", "../../../../etc/passwd", "/etc/passwd", "sub/x.safetensors", ".."):
        index = json.loads(index_path.read_text())
        index["weight_map"] = {name: bad for name in index["weight_map"]}
        index_path.write_text(json.dumps(index))
        with pytest.raises(FolderError, match="not plain file names"):
            find_weights(folder)
    assert json.loads(index_path.read_text())["weight_map"]  # the index was sharded to begin with


def test_symlinked_weight_files_as_in_the_hub_cache_still_load(tmp_path):
    saved = tmp_path / "saved"
    model = Encoder(EncoderConfig())
    model.save_pretrained(saved)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        blob = blobs / f"blob-{file.name}"
        file.rename(blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    loaded = Encoder.from_pretrained(snapshot)
    assert torch.equal(loaded.embed.weight, model.embed.weight)


@pytest.mark.parametrize("name", ["../encoder", "", "."])  # "" and "." would name the pipeline folder itself
def test_component_names_that_are_paths_are_refused(tmp_path, name):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index[name] = index.pop("encoder")
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(pipelines.folder.components.FolderError, match="not a plain folder name"):
        Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})


def test_every_library_class_is_declared_to_the_registry_by_the_package_face():
    """The registry finds a library class by importing only the module the face declares for it; a class
    decorated with @library_class but not declared could not be found from a folder in a fresh process."""
    pipelines.import_library_classes()
    declared = set(registry._DECLARED)
    assert declared == set(registry._CLASSES) and "TextToImagePipeline" in declared
