"""A loop body marked `same_work_by_layout` runs once per kind within an estimate and is replayed after: our tiny
VAE's tiled decode (at 512x512, issue 41's `placement plan tiny-dit --height 512 --width 512`, 21x21 = 441 tiles;
here 128x128, 5x5) decodes two tiles on fake tensors instead of every one, with exactly the peak and FLOPs of the
tile-by-tile run (`benchmarks/planning_time.py --rows tiny-tiled` times the 512x512 plan)."""

from __future__ import annotations

import torch

from pipelines.text_to_image.models.autoencoder_kl import AutoencoderKL
from placement.activations.estimate import estimate_call
from placement.activations.memo import CACHE_ENV, MEMO_ENV, same_work_by_layout


def tiled_tiny_vae() -> tuple[AutoencoderKL, list[int]]:
    """The tiny preset's VAE (32-pixel tiles) with tiling on, on meta, counting the tiles it really decodes."""
    vae = AutoencoderKL(AutoencoderKL.presets["tiny"]).to("meta")
    vae.enable_tiling()
    decoded = []
    decode_tile = vae._decode_tile

    def counted(latents: torch.Tensor) -> torch.Tensor:
        decoded.append(tuple(latents.shape))
        return decode_tile(latents)

    vae._decode_tile = counted
    return vae, decoded


def test_the_tiled_decode_estimate_runs_once_per_tile_kind_and_equals_the_tile_by_tile_one(monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "0")
    latents = torch.empty(1, 4, 64, 64, device="meta")  # 128x128 pixels: 5x5 tiles of 16 latent pixels
    estimates, counts = {}, {}
    for memo in ("1", "0"):
        monkeypatch.setenv(MEMO_ENV, memo)
        vae, decoded = tiled_tiny_vae()
        estimates[memo] = estimate_call(vae, (latents,), method="decode")
        counts[memo] = decoded
    assert len(counts["0"]) == 5 * 5 and set(counts["0"]) == {(1, 4, 16, 16)}  # every tile, one shape
    # Memo on: the first tile (it sizes the canvas) and one tile the others replay.
    assert len(counts["1"]) == 2
    on, off = estimates["1"], estimates["0"]
    assert on.peak_bytes == off.peak_bytes and on.flops == off.flops and on.bytes_touched == off.bytes_touched
    assert on.output.shape == off.output.shape == (1, 3, 128, 128)


def test_outside_an_estimate_the_function_is_plain():
    calls = []

    @same_work_by_layout(position="at")
    def add(x: torch.Tensor, *, at: int) -> torch.Tensor:
        calls.append(at)
        return x + at

    assert add(torch.zeros(2), at=1).tolist() == [1.0, 1.0] and add(torch.zeros(2), at=2).tolist() == [2.0, 2.0]
    assert calls == [1, 2]
