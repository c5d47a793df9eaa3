"""Every bad checkpoint gets a typed error naming the culprit, and no half-loaded model."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file

import pipelines.checkpoint.streaming as loading_module
import pipelines.checkpoint.saving as saving_module
from pipelines.checkpoint import (
    CheckpointSaveError,
    CheckpointShapeError,
    WeightsNotFoundError,
    find_weights,
    load_weights,
)
from pipelines.errors import FolderError

from checkpoint_models import TinyModel, tiny_ids, tiny_model
from same_output import assert_same_output

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "m"
    tiny_model().save_pretrained(folder)
    return folder


@pytest.fixture
def sharded(tmp_path):
    folder = tmp_path / "s"
    tiny_model().save_pretrained(folder, max_shard_size=3000)
    return folder


def load(folder, **kwargs):
    return TinyModel.from_pretrained(folder, progress=False, **kwargs)


def rewrite_weights(folder, edit):
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS)


def test_missing_key_is_named(saved):
    rewrite_weights(saved, lambda t: t.pop("blocks.2.fc1.bias"))
    with pytest.raises(FolderError, match=r"missing 1 key.*'blocks\.2\.fc1\.bias'"):
        load(saved)


def test_unexpected_key_is_named(saved):
    rewrite_weights(saved, lambda t: t.update({"extra.weight": torch.zeros(2)}))
    with pytest.raises(FolderError, match=r"unexpected key.*'extra\.weight'"):
        load(saved)


def test_shape_mismatch_names_the_key_and_both_shapes(saved):
    rewrite_weights(saved, lambda t: t.update({"blocks.0.fc2.weight": torch.zeros(16, 31)}))
    expected = r"'blocks\.0\.fc2\.weight': checkpoint \[16, 31\].*model \[16, 32\]"
    with pytest.raises(CheckpointShapeError, match=expected):
        load(saved)


def test_missing_shard_is_named(sharded):
    shard = sorted(sharded.glob("*-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(WeightsNotFoundError, match=shard.name):
        load(sharded)


def test_index_naming_a_missing_file_is_named(sharded):
    index_path = sharded / INDEX
    index = json.loads(index_path.read_text())
    index["weight_map"]["embed.weight"] = "nowhere-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightsNotFoundError, match="nowhere-00009-of-00009.safetensors"):
        load(sharded)


def test_index_that_is_not_json_is_named(sharded):
    (sharded / INDEX).write_text("{not json")
    with pytest.raises(FolderError, match=INDEX):
        load(sharded)


def test_shards_without_their_index(sharded):
    (sharded / INDEX).unlink()
    with pytest.raises(WeightsNotFoundError, match="index.*missing"):
        load(sharded)


def test_truncated_safetensors_file_is_named(saved):
    path = saved / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(FolderError, match=WEIGHTS):
        load(saved)


def test_garbage_safetensors_file_is_named(saved):
    (saved / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(FolderError, match=WEIGHTS):
        load(saved)


def test_unknown_config_field_is_named(saved):
    path = saved / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "widht": 3}))
    with pytest.raises(FolderError, match="unknown field 'widht'"):
        load(saved)


def test_ill_typed_config_field_is_named(saved):
    path = saved / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "depth": "four"}))
    with pytest.raises(FolderError, match="field 'depth'"):
        load(saved)


def test_missing_variant_lists_the_variants_that_exist(saved):
    tiny_model().to(torch.float16).save_pretrained(saved, variant="fp16")
    with pytest.raises(WeightsNotFoundError, match=r"'bf16'.*Variants present: default, fp16"):
        load(saved, variant="bf16")


def test_pickle_weights_are_never_unpickled(tmp_path):
    folder = tmp_path / "p"
    tiny_model().save_pretrained(folder)
    (folder / WEIGHTS).unlink()
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(WeightsNotFoundError, match="never unpickled"):
        load(folder)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(WeightsNotFoundError, match="nope"):
        load(tmp_path / "nope")


def test_failed_save_leaves_the_existing_checkpoint_loadable(saved, monkeypatch):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    calls = []

    def failing_save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(saving_module, "save_file", failing_save_file)
    with pytest.raises(CheckpointSaveError, match="injected"):
        tiny_model(seed=5).save_pretrained(saved, max_shard_size=3000)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert [p.name for p in saved.parent.iterdir()] == ["m"]  # no temporary folder left behind
    assert_same_output(load(saved)(tiny_ids(tiny_model().config)), tiny_model()(tiny_ids(tiny_model().config)))


def test_shared_untied_tensors_are_refused_with_advice(tmp_path):
    model = tiny_model()
    model._tied_weights_keys = {}  # the tie exists but is not declared
    with pytest.raises(CheckpointSaveError, match="_tied_weights_keys"):
        model.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_failure_while_streaming_leaves_no_loaded_tensor(saved, monkeypatch):
    weights = find_weights(saved)
    with init_empty_weights():
        model = TinyModel(tiny_model().config)
    real = loading_module.set_tensor
    count = []

    def failing(read, value):
        count.append(read.entry.name)
        if len(count) == 5:
            raise RuntimeError("out of memory (injected)")
        return real(read, value)

    monkeypatch.setattr(loading_module, "set_tensor", failing)
    with pytest.raises(RuntimeError, match="injected"):
        load_weights(model, weights, tied_weights=TinyModel._tied_weights_keys, progress=False)
    assert all(t.device.type == "meta" for t in model.state_dict().values())


def test_ignored_unexpected_keys_are_skipped_not_loaded(saved):
    rewrite_weights(saved, lambda t: t.update({"embed.position_ids": torch.arange(3)}))
    weights = find_weights(saved)
    with init_empty_weights():
        model = TinyModel(tiny_model().config)
    load_weights(model, weights, tied_weights=TinyModel._tied_weights_keys,
                 ignore_unexpected=[r"position_ids$"], progress=False)
    assert torch.equal(model.blocks[0].fc1.weight, tiny_model().blocks[0].fc1.weight)


def test_absent_accelerator_is_refused_before_loading(saved):
    from placement.errors import InvalidDeviceError

    with pytest.raises(InvalidDeviceError, match=r"asks for GPU 99 \(no GPU for 'cuda:99'\)"):
        load(saved, device_map={"": 99})


@pytest.mark.parametrize("kind", ["a FIFO", "a character device", "a folder"])
@pytest.mark.parametrize("which", ["single file", "index", "shard"])
def test_a_weights_name_that_is_no_regular_file_is_named_as_what_it_is(tmp_path, kind, which):
    import os

    folder = tmp_path / "m"
    tiny_model().save_pretrained(folder, max_shard_size="10GB" if which == "single file" else 200)
    path = {"single file": folder / WEIGHTS, "index": folder / INDEX,
            "shard": next(iter(sorted(folder.glob("*-of-*"))), None)}[which]
    path.unlink()
    {"a FIFO": lambda: os.mkfifo(path), "a character device": lambda: os.symlink("/dev/zero", path),
     "a folder": path.mkdir}[kind]()
    with pytest.raises(FolderError, match=rf"{path.name}' is {kind}.*, not a regular file"):
        find_weights(folder)  # never opened: a FIFO would block, /dev/zero read without end
