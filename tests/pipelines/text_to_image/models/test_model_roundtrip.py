"""Every tiny reference model round-trips bit-exact through save_pretrained/from_pretrained:
unsharded, sharded (max_shard_size = 75% of the model), and as an fp16 variant."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.text_to_image.models import AutoencoderKL, DiT, TextEncoder, UNet

from reference_inputs import run, tiny
from same_output import assert_same_output

MODELS = [(TextEncoder, "tiny"), (TextEncoder, "tiny-t5"), (UNet, "tiny"), (DiT, "tiny"), (AutoencoderKL, "tiny"),
          (AutoencoderKL, "tiny-16ch")]
IDS = [f"{cls.__name__}-{preset}" for cls, preset in MODELS]
WEIGHTS = "diffusion_pytorch_model"


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def assert_bit_exact(original, loaded):
    expected, actual = original.state_dict(), loaded.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    assert loaded.config == original.config


@pytest.mark.parametrize("cls, preset", MODELS, ids=IDS)
def test_unsharded_round_trip(tmp_path, cls, preset):
    model = tiny(cls, preset)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", f"{WEIGHTS}.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == cls.__name__
    loaded = cls.from_pretrained(tmp_path, progress=False).eval()
    assert_bit_exact(model, loaded)
    assert_same_output(run(loaded), run(model))


@pytest.mark.parametrize("cls, preset", MODELS, ids=IDS)
def test_sharded_round_trip_at_75_percent(tmp_path, cls, preset):
    model = tiny(cls, preset)
    model.save_pretrained(tmp_path, max_shard_size=int(0.75 * model_bytes(model)))
    index = json.loads((tmp_path / f"{WEIGHTS}.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob(f"{WEIGHTS}-*.safetensors"))
    # Many small tensors, none above 75%: the greedy packing needs exactly two shards.
    assert shards == [f"{WEIGHTS}-00001-of-00002.safetensors", f"{WEIGHTS}-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == model_bytes(model)
    loaded = cls.from_pretrained(tmp_path, progress=False).eval()
    assert_bit_exact(model, loaded)
    assert_same_output(run(loaded), run(model))


@pytest.mark.parametrize("cls, preset", MODELS, ids=IDS)
def test_fp16_variant_round_trip(tmp_path, cls, preset):
    model = tiny(cls, preset)
    half = tiny(cls, preset).to(torch.float16)
    model.save_pretrained(tmp_path)
    half.save_pretrained(tmp_path, variant="fp16")
    assert (tmp_path / f"{WEIGHTS}.fp16.safetensors").is_file()
    assert_bit_exact(half, cls.from_pretrained(tmp_path, variant="fp16", progress=False))
    assert_bit_exact(model, cls.from_pretrained(tmp_path, progress=False))


def inside_a_no_split_block(model, key: str) -> bool:
    """True when `key` names a strict descendant of a `_no_split_modules` block (a block cut in two)."""
    parts = key.split(".") if key else []
    for depth in range(1, len(parts)):
        ancestor = model.get_submodule(".".join(parts[:depth]))
        if type(ancestor).__name__ in model._no_split_modules:
            return True
    return False


@pytest.mark.parametrize("cls", [UNet, DiT, AutoencoderKL], ids=lambda cls: cls.__name__)
def test_offloaded_load_computes_the_same_and_keeps_blocks_whole(tmp_path, cls):
    """device_map="auto" with CPU room for 60% of the model: the rest streams from disk through accelerate's
    hooks. Sums of two submodules' outputs live inside one no-split module, so any cut works."""
    model = tiny(cls)
    model.save_pretrained(tmp_path / "model")
    loaded = cls.from_pretrained(tmp_path / "model", device_map="auto", max_memory={"cpu": f"{int(0.6 * model_bytes(model))}B"},
                                 offload_folder=tmp_path / "offload", progress=False).eval()
    assert {"cpu", "disk"} <= set(loaded.hf_device_map.values())
    assert not [key for key in loaded.hf_device_map if inside_a_no_split_block(loaded, key)]
    assert_same_output(run(loaded), run(model))
