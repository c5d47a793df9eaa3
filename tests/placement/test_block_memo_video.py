"""The block memo on causal video VAEs: AutoencoderKLWan decodes one latent frame per decoder call and encodes
four video frames per encoder call, writing each convolution's last frames into a cache list. From the third call
on, calls are replayed with their writes; the estimate must be the full per-frame run's, to the byte, with the
same submodule calls in the same order, at every frame count, tiled or not, Wan 2.1's VAE and Wan 2.2's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights

from test_block_memo import with_and_without_memo

diffusers = pytest.importorskip("diffusers")

BF16 = torch.bfloat16
# Wan 2.1's layout (the VAE of Wan 2.1 and of Wan 2.2 A14B) at tiny widths, and Wan 2.2 TI2V's (residual blocks,
# patch size 2, 48 latent channels at full size).
TINY_WAN_21 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
                   latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
TINY_WAN_22 = dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                   temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
                   out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
_DATA = Path(__file__).resolve().parents[2] / "pipelines" / "presets" / "data"  # the real pipelines' configs
_REAL = json.loads((_DATA / "real_pipelines.json").read_text())["pipelines"]


def meta(*shape):
    return torch.empty(*shape, device="meta", dtype=BF16)


def wan_vae(config: dict):
    with init_empty_weights():
        return diffusers.AutoencoderKLWan.from_config(config).eval()


def assert_same_estimate(monkeypatch, vae, args, *, method: str, replayed: int = 0) -> int:
    """The peak with the memo equal to the byte to the peak without, every submodule call the same in order, and
    at least `replayed` calls replayed; returns the peak."""
    with_memo, without, replays = with_and_without_memo(monkeypatch, vae, args, method=method, dtype=BF16)
    assert with_memo == without
    assert replays >= replayed
    return with_memo[0]


@pytest.mark.parametrize("config", [TINY_WAN_21, TINY_WAN_22], ids=["wan2.1", "wan2.2"])
@pytest.mark.parametrize("frames", [1, 2, 4, 7])
def test_decode_equals_the_per_frame_run(monkeypatch, config, frames):
    vae = wan_vae(config)
    side = 4 if config.get("patch_size") else 8
    # Frame 0 sees an empty cache, frame 1 one a frame deep, frame 2 on the steady one: each later one a replay.
    peak = assert_same_estimate(monkeypatch, vae, (meta(1, 4, frames, side, side),), method="decode",
                                replayed=max(frames - 3, 0))
    assert peak > 0


@pytest.mark.parametrize("config", [TINY_WAN_21, TINY_WAN_22], ids=["wan2.1", "wan2.2"])
@pytest.mark.parametrize("frames", [5, 17])
def test_encode_equals_the_per_chunk_run(monkeypatch, config, frames):
    vae = wan_vae(config)
    channels = config.get("in_channels", 3) // (config.get("patch_size") or 1) ** 2
    side = 64 if config.get("patch_size") else 32
    # Chunks: the first frame, then four frames each (the third chunk on sees the steady cache).
    assert_same_estimate(monkeypatch, vae, (meta(1, channels, frames, side, side),), method="encode",
                         replayed=max((frames - 1) // 4 - 2, 0))


@pytest.mark.parametrize("frames", [2, 5])
def test_tiled_decode_equals_the_per_frame_run(monkeypatch, frames):
    # Tiles of 64 px (8 latents) every 32 px over a 16x24 latent: six tiles, four of one size; each tile runs the
    # causal loop again on a new cache list, and replays recorded on another tile apply.
    vae = wan_vae(TINY_WAN_21)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    assert_same_estimate(monkeypatch, vae, (meta(1, 4, frames, 16, 24),), method="decode", replayed=1)


def test_real_width_wan_vae_decode_and_encode(monkeypatch):
    """The published Wan 2.1 VAE config (Wan 2.2 A14B's VAE) at a small size: decode 6 latent frames, encode 13
    video frames."""
    vae = wan_vae(_REAL["wan2.1-t2v-14b"]["components"]["vae"]["config"])
    assert_same_estimate(monkeypatch, vae, (meta(1, 16, 6, 8, 8),), method="decode", replayed=3)
    assert_same_estimate(monkeypatch, vae, (meta(1, 3, 13, 32, 32),), method="encode", replayed=1)


@pytest.mark.slow
def test_real_wan_vae_at_the_benchmark_call(monkeypatch):
    """Wan 2.2 A14B's decode at 480x832x81 (21x60x104 latents), the call `benchmarks/planning_time.py` plans."""
    vae = wan_vae(_REAL["wan2.1-t2v-14b"]["components"]["vae"]["config"])
    assert_same_estimate(monkeypatch, vae, (meta(1, 16, 21, 60, 104),), method="decode", replayed=18)
