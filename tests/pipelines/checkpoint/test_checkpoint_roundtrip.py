"""Save -> load round trips of a user-defined ModelMixin: bit-exact, in diffusers' folder format."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.checkpoint import find_weights, read_header
from pipelines.checkpoint.files import WeightsNaming

from checkpoint_models import TinyConfig, TinyModel, saved_bytes, tiny_ids, tiny_model
from same_output import assert_same_output


def assert_same_weights(original, loaded, *, fp32_modules=("norm_out",)):
    """Bit-exact, except that `_keep_in_fp32_modules` are loaded as float32 (exactly upcast)."""
    expected, actual = original.state_dict(), loaded.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        if name.split(".")[0] in fp32_modules:
            tensor = tensor.float()
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def test_unsharded_round_trip_is_bit_exact(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["_class_name"] == "TinyModel" and config["width"] == 16
    loaded = TinyModel.from_pretrained(tmp_path / "m", progress=False)
    assert_same_weights(model, loaded)
    assert loaded.hf_device_map is None
    assert loaded.head.weight is loaded.embed.weight  # tied again after init_empty_weights
    assert_same_output(loaded(tiny_ids(model.config)), model(tiny_ids(model.config)))


def test_sharded_at_75_percent_gives_two_shards_and_an_index(tmp_path):
    model = tiny_model(depth=6)
    total = saved_bytes(model)
    model.save_pretrained(tmp_path / "m", max_shard_size=int(0.75 * total))
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == [
        "config.json",
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "m" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(model.state_dict()) - {"head.weight"}
    loaded = TinyModel.from_pretrained(tmp_path / "m", progress=False)
    assert_same_weights(model, loaded)


def test_size_strings_are_parsed_as_bytes(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m", max_shard_size="2KB")  # 2000 bytes, never kilobits
    weights = find_weights(tmp_path / "m")
    assert weights.is_sharded
    assert all(sum(e.nbytes for e in read_header(f)) <= 2000 or len(read_header(f)) == 1 for f in weights.files)


def test_variant_round_trip_keeps_the_default_weights(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    half = tiny_model().to(torch.float16)
    half.save_pretrained(tmp_path / "m", variant="fp16")
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == ["config.json", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors"]
    loaded_half = TinyModel.from_pretrained(tmp_path / "m", variant="fp16", progress=False)
    # No torch_dtype: every tensor as saved, fp32-kept modules too (as diffusers loads, and as sizing assumes).
    assert_same_weights(half, loaded_half, fp32_modules=())
    assert_same_weights(model, TinyModel.from_pretrained(tmp_path / "m", progress=False))


def test_sharded_variant_uses_diffusers_names(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m", variant="fp16", max_shard_size=int(0.75 * saved_bytes(model)))
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == [
        "config.json",
        "diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.fp16.json",
    ]
    assert_same_weights(model, TinyModel.from_pretrained(tmp_path / "m", variant="fp16", progress=False))


def test_resave_with_fewer_shards_removes_the_stale_ones(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m", max_shard_size=2000)
    model.save_pretrained(tmp_path / "m")
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_torch_dtype_casts_but_keeps_fp32_modules_and_integer_buffers(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    loaded = TinyModel.from_pretrained(tmp_path / "m", torch_dtype=torch.bfloat16, progress=False)
    assert loaded.blocks[0].fc1.weight.dtype == torch.bfloat16
    assert loaded.blocks[0].gate.dtype == torch.bfloat16
    assert loaded.norm_out.weight.dtype == torch.float32  # _keep_in_fp32_modules
    assert loaded.steps.dtype == torch.int64
    assert torch.equal(loaded.blocks[0].fc1.weight, model.blocks[0].fc1.weight.to(torch.bfloat16))
    out = loaded(tiny_ids(model.config))
    assert torch.allclose(out.float(), model(tiny_ids(model.config)), atol=0.1, rtol=0.05)


def test_weights_naming_for_transformers_stem():
    naming = WeightsNaming(weights_name="model", variant="fp16")
    assert naming.single_file == "model.fp16.safetensors"
    assert naming.index_file == "model.safetensors.index.fp16.json"
    assert naming.shard_file(1, 3) == "model.fp16-00001-of-00003.safetensors"
    assert naming.owns("model.fp16-00002-of-00003.safetensors")
    assert not naming.owns("model.safetensors")
    with pytest.raises(ValueError, match="variant"):
        WeightsNaming(variant="../evil")


def test_config_round_trip_and_from_config():
    config = TinyConfig(width=8, depth=2)
    model = TinyModel.from_config({"_class_name": "TinyModel", **config.model_dump()})
    assert model.config == config


def test_offload_index_serves_tied_weights_from_their_source(tmp_path):
    from pipelines.errors import FolderError

    tiny_model().save_pretrained(tmp_path / "m")
    weights = find_weights(tmp_path / "m")
    index = weights.offload_index(
        ["blocks.0.fc1.weight", "head.weight"],
        lambda entry: torch.float16,
        tied_weights={"head.weight": "embed.weight"},
    )
    assert index["head.weight"]["weight_name"] == "embed.weight"
    assert index["blocks.0.fc1.weight"] == {
        "safetensors_file": str(tmp_path / "m" / "diffusion_pytorch_model.safetensors"),
        "weight_name": "blocks.0.fc1.weight",
        "dtype": "float16",
    }
    with pytest.raises(FolderError, match="'head.weight'.*tied_weights"):
        weights.offload_index(["head.weight"], lambda entry: entry.dtype)


def test_dict_map_with_tied_weight_on_disk_and_source_on_cpu(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "m")
    loaded = TinyModel.from_pretrained(tmp_path / "m", device_map={"": "cpu", "head": "disk"}, offload_folder=tmp_path,
                                       progress=False)
    assert loaded.hf_device_map["head"] == "disk"
    assert_same_output(loaded(tiny_ids(model.config)), model(tiny_ids(model.config)))
