"""What planned VAE tiling saves, and what its estimate costs, on the real VAEs at full size (bf16, on meta).

    python benchmarks/vae_tiling.py            # about two minutes on a 2-core machine
    python benchmarks/vae_tiling.py --naive    # also time the naive estimate (every tile run): many minutes
    python benchmarks/vae_tiling.py --plans    # also plan HunyuanVideo 720x1280x129 on 2x24 GiB: a few minutes

For each VAE and call: the decode's activation peak untiled and tiled (each class's own tiled code with its
own tile sizes: `pipelines.hf.calls.vae_techniques`), and the seconds each estimate took. The tiled estimate
replays the decoder by input shape; the anchor is running every tile on fake tensors (what estimating the
tiled call directly costs): `--naive` times it and checks the two peaks are equal.

`--plans`: issue 19's case as a user meets it: HunyuanVideo (published configs, full depth, bf16, on meta) at
720x1280x129 on 2 x 24 GiB with 64 or 32 GiB of CPU RAM, planned with tiling left to the planner and forbidden
(`call={"vae_tiling": False}`): the verdict, where the VAE runs and its activations, or the error's first words.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

from pipelines.hf.calls.capture import ExampleCall
from pipelines.hf.calls.vae_techniques import WithTechniques, tile_description
from placement.plan_schema import MemoryTechnique
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

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
        entries = json.loads((PIPELINES_DATA / name).read_text())["pipelines"]
        if family in entries:
            spec = entries[family]["components"]["vae"]
            with init_empty_weights():
                return getattr(diffusers, spec["class"]).from_config(spec["config"]).eval()
    raise KeyError(family)


def _setting(vae, *names: str):
    # Some VAEs derive a ratio in __init__ (LTX, DC-AE) and leave the config's None: the attribute is the truth.
    for name in names:
        value = vae.__dict__.get(name, vae.config.get(name))
        if value is not None:
            return value
    return None


def spatial_factor(vae) -> int:
    """Pixels per latent cell along a side (diffusers' `vae_scale_factor` for this VAE class)."""
    explicit = _setting(vae, "spatial_compression_ratio", "scale_factor_spatial")
    if explicit is not None:
        return int(explicit)
    if vae.config.get("temperal_downsample") is not None:  # Wan / Qwen-Image VAEs: one halving per flag
        return 2 ** len(vae.config["temperal_downsample"])
    return 2 ** (len(_setting(vae, "block_out_channels", "encoder_block_out_channels")) - 1)


def latent_frames(frames: int, vae) -> int:
    """Latent frames of a video of `frames` frames: the first alone, then one per temporal step."""
    factor = _setting(vae, "temporal_compression_ratio", "scale_factor_temporal")
    if factor is None:
        downsample = vae.config.get("temperal_downsample")
        factor = 2 ** sum(bool(flag) for flag in downsample) if downsample is not None else 1
    return (frames - 1) // int(factor) + 1


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


def plans() -> None:
    from pipelines import Pipeline
    from real_folders import write_folder

    folder = write_folder(Path(tempfile.mkdtemp()) / "hunyuanvideo", "hunyuanvideo")
    call = {"height": 720, "width": 1280, "num_frames": 129, "num_inference_steps": 1}
    print("\n| HunyuanVideo 720x1280x129, bf16 | CPU RAM | tiling | verdict or error | vae runs on | vae activations |")
    print("|---|---|---|---|---|---:|")
    for cpu in ("64GiB", "32GiB"):
        for tiling in (None, False):
            budget = {0: "24GiB", 1: "24GiB", "cpu": cpu}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = Pipeline.plan_placement(folder, max_memory=budget, torch_dtype=DTYPE,
                                                   call={**call, "vae_tiling": tiling})
            except Exception as error:  # the outcome being measured: its type and first words
                print(f"| 2 x 24 GiB | {cpu} | {tiling} | {type(error).__name__}: {str(error)[:90]}... | - | - |")
                continue
            vae = plan.components["vae"]
            techniques = ", ".join(used.technique.value for used in vae.memory_techniques) or "none"
            print(f"| 2 x 24 GiB | {cpu} | {tiling} (on: {techniques}) | {plan.verdict.kind.value} | "
                  f"{vae.execution_device} | {vae.activation_bytes / GiB:.2f} GiB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--naive", action="store_true", help="also run every tile (the anchor); slow")
    parser.add_argument("--plans", action="store_true", help="also plan HunyuanVideo on 2 x 24 GiB")
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
    if args.plans:
        plans()


if __name__ == "__main__":
    main()
