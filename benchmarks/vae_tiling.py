"""What planned VAE tiling saves, and what its estimate costs, on the real VAEs at full size (bf16, on meta).

    python benchmarks/vae_tiling.py            # about two minutes on a 2-core machine
    python benchmarks/vae_tiling.py --naive    # also time the naive estimate (every tile run): many minutes

For each VAE and call: the decode's activation peak untiled and tiled (each class's own tiled code with its
own tile sizes: `pipelines.hf.calls.vae_techniques`), and the seconds each estimate took. The tiled estimate
replays the decoder by input shape; the anchor is running every tile on fake tensors (what estimating the
tiled call directly costs): `--naive` times it and checks the two peaks are equal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipelines.hf.calls.shapes import latent_frames, spatial_factor
from pipelines.hf.calls.spec import ExampleCall
from pipelines.hf.calls.vae_techniques import WithTechniques, tile_description
from placement.plan_schema import MemoryTechnique

DATA = Path(__file__).resolve().parent / "data"
DTYPE = torch.bfloat16
GiB = 2**30
CASES = [  # (family, height, width, frames or None)
    ("sdxl-base-1.0", 2048, 2048, None), ("flux1-dev", 2048, 2048, None),
    ("cogvideox-5b", 480, 720, 49), ("wan2.1-t2v-1.3b", 720, 1280, 81), ("hunyuanvideo", 720, 1280, 129),
]


def vae_of(family: str):
    import diffusers
    from accelerate import init_empty_weights

    for name in ("real_pipelines.json", "extra_pipelines.json"):
        entries = json.loads((DATA / name).read_text())["pipelines"]
        if family in entries:
            spec = entries[family]["components"]["vae"]
            with init_empty_weights():
                return getattr(diffusers, spec["class"]).from_config(spec["config"]).eval()
    raise KeyError(family)


def decode_call(vae, height: int, width: int, frames: int | None) -> ExampleCall:
    factor = spatial_factor(vae)
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    grid = (height // factor, width // factor)
    shape = (1, channels, *grid) if frames is None else (1, channels, latent_frames(frames, vae), *grid)
    return ExampleCall(args=(torch.empty(shape, device="meta", dtype=DTYPE),), method="decode")


def timed(estimate) -> tuple[int, float]:
    start = time.perf_counter()
    peak = estimate()
    return peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--naive", action="store_true", help="also run every tile (the anchor); slow")
    args = parser.parse_args()
    print("| VAE | call | untiled GiB (s) | tiled GiB (s) | x smaller | tiles | naive tiled GiB (s) |")
    print("|---|---|---:|---:|---:|---|---:|")
    for family, height, width, frames in CASES:
        vae = vae_of(family)
        call = decode_call(vae, height, width, frames)
        untiled, untiled_s = timed(lambda: call.estimate(vae, dtype=DTYPE))
        tiled_call = WithTechniques(call=call, techniques=frozenset({MemoryTechnique.VAE_TILING}))
        tiled, tiled_s = timed(lambda: tiled_call.estimate(vae, dtype=DTYPE))
        naive = "-"
        if args.naive:
            vae.use_tiling = True
            full, full_s = timed(lambda: call.estimate(vae, dtype=DTYPE))
            vae.use_tiling = False
            naive = f"{full / GiB:.2f} ({full_s:.0f})" + ("" if full == tiled else " DIFFERS")
        size = f"{height}x{width}" + (f"x{frames}" if frames else "")
        print(f"| {type(vae).__name__} ({family}) | {size} | {untiled / GiB:.2f} ({untiled_s:.1f}) | "
              f"{tiled / GiB:.2f} ({tiled_s:.1f}) | {untiled / tiled:.1f} | {tile_description(vae)} | {naive} |",
              flush=True)


if __name__ == "__main__":
    main()
