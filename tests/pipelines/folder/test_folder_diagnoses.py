"""Folders that are wrong in a way the loader must name: a component subfolder that is a symlink loop (to itself,
or back to the pipeline folder) and a transformers component saved as pickle only (`pytorch_model.bin`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pipelines import FolderError, Pipeline, TextToImagePipeline, WeightsNotFoundError
import pipelines

from own_fixtures import save_preset

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("diagnoses") / "tiny-dit")[0]


@pytest.mark.parametrize("link, says", [
    ("vae", r"is a symlink to itself \(a symlink loop\)"),
    (".", r"is a symlink to '.*pipe': the pipeline folder or a folder above it"),
    ("..", r"is a symlink to '.*': the pipeline folder or a folder above it"),
])
def test_a_component_folder_linked_in_a_loop_is_named(saved, tmp_path, link, says):
    folder = tmp_path / "pipe"
    shutil.copytree(saved, folder)
    shutil.rmtree(folder / "vae")
    os.symlink(link, folder / "vae")
    for entry in (TextToImagePipeline.from_pretrained, TextToImagePipeline.plan_placement):
        with pytest.raises(FolderError, match=rf"Component 'vae': its folder .*vae' {says}.*pass vae="):
            entry(folder)


def test_a_component_folder_linked_elsewhere_still_loads(saved, tmp_path):
    folder = tmp_path / "pipe"
    shutil.copytree(saved, folder)
    os.rename(folder / "vae", tmp_path / "vae-elsewhere")
    os.symlink(tmp_path / "vae-elsewhere", folder / "vae")
    assert TextToImagePipeline.from_pretrained(folder, progress=False).vae is not None


def test_a_pickle_only_transformers_component_says_why_and_how_to_convert(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    folder = tmp_path / "pipe"
    shutil.copytree(saved, folder)
    shutil.rmtree(folder / "text_encoder")
    encoder.config.architectures = ["CLIPTextModel"]
    encoder.config.save_pretrained(folder / "text_encoder")
    torch.save(encoder.state_dict(), folder / "text_encoder" / "pytorch_model.bin")  # as older transformers wrote
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "CLIPTextModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    says = (r"holds only pickle weights \('pytorch_model.bin'\), which are never unpickled here: unpickling can run "
            r"arbitrary code.*from_pretrained\(folder\).save_pretrained\(folder\) writes safetensors.*"
            r"safe_serialization=True")
    with pytest.raises(WeightsNotFoundError, match=says):
        Pipeline.from_pretrained(folder, generic=True, device_map="balanced", progress=False)
    with pytest.raises(WeightsNotFoundError, match=says):
        pipelines.load_model(folder / "text_encoder", device_map="auto", progress=False)


def test_pickle_only_is_one_policy_with_or_without_a_device_map_unless_opted_in(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    folder = tmp_path / "pipe"
    shutil.copytree(saved, folder)
    shutil.rmtree(folder / "text_encoder")
    encoder.config.architectures = ["CLIPTextModel"]
    encoder.config.save_pretrained(folder / "text_encoder")
    torch.save(encoder.state_dict(), folder / "text_encoder" / "pytorch_model.bin")  # pickle only
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "CLIPTextModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    unpickled = []
    original = torch.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "load", lambda *args, **kwargs: unpickled.append(kwargs) or original(*args, **kwargs))
        for device_map in (None, "balanced"):
            with pytest.raises(WeightsNotFoundError, match=r"pytorch_model.bin.*never unpickled here.*"
                                                           r"use_safetensors=False"):
                Pipeline.from_pretrained(folder, generic=True, device_map=device_map, progress=False)
        assert unpickled == []  # refused before the owner library read the file
        with pytest.raises(pipelines.LoadError, match="a placed load reads safetensors only"):
            Pipeline.from_pretrained(folder, generic=True, device_map="balanced", use_safetensors=False)
        pipe = Pipeline.from_pretrained(folder, generic=True, device_map=None, use_safetensors=False, progress=False)
    assert unpickled and all(call.get("weights_only") is True for call in unpickled)  # read by transformers, safely
    ids = torch.tensor([[0, 5, 9, 1]])
    with torch.no_grad():
        assert torch.equal(pipe.text_encoder(ids).last_hidden_state, encoder(ids).last_hidden_state)
