"""Our folder format is diffusers' own: each side reads the other's sharded, variant checkpoints."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from pipelines.checkpoint import find_weights, load_weights, save_weights

diffusers = pytest.importorskip("diffusers")


def tiny_vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        latent_channels=2, norm_num_groups=4, layers_per_block=1,
    ).eval()


def assert_equal_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name].to(sb[name].dtype), sb[name]), name


def test_we_load_what_diffusers_saves_sharded_with_a_variant(tmp_path):
    vae = tiny_vae().to(torch.float16)
    vae.save_pretrained(tmp_path / "vae", variant="fp16", max_shard_size=5_000)
    weights = find_weights(tmp_path / "vae", variant="fp16")
    assert weights.is_sharded and len(weights.files) > 1
    with init_empty_weights():
        empty = diffusers.AutoencoderKL.from_config(diffusers.AutoencoderKL.load_config(tmp_path / "vae"))
    load_weights(empty, weights, progress=False)
    assert_equal_state(vae, empty)


def test_diffusers_loads_what_we_save_sharded_with_a_variant(tmp_path):
    vae = tiny_vae()
    folder = tmp_path / "vae"
    folder.mkdir()
    vae.save_config(folder)
    written = save_weights(vae.state_dict(), folder, variant="fp16", max_shard_size=20_000)
    assert written[-1].name == "diffusion_pytorch_model.safetensors.index.fp16.json"
    loaded = diffusers.AutoencoderKL.from_pretrained(folder, variant="fp16")
    assert_equal_state(vae, loaded)
