"""Load benchmark (issue 2): our loader (`pipelines.load_model(device_map="cpu")`, each tensor streamed from its
shard) vs raw file reads vs safetensors' `load_file` (`benchmarks/load.py` compares our device-mapped load with diffusers' own `from_pretrained`).

A model of >= 1 GB (transformers' T5EncoderModel, 2048 wide with 8192-wide feed-forwards: big square and
rectangular Linear weights, as in real checkpoints) is saved in shards once; then each variant loads it in a fresh subprocess, which reports its
wall time and its peak RSS (`resource.getrusage`) above the RSS it had before loading (imports excluded).
The files are read once beforehand, so every variant reads from the page cache: the comparison is of the
loaders, not of the disk. safetensors (>= 0.6) maps tensors lazily, so a load is only finished once every page
is resident: each variant touches one element per memory page of what it loaded, inside the timing.
The model is saved by a child process too: a child inherits its parent's peak RSS across fork, which would
hide the loaders' own peaks. Each variant runs `--repeats` times, alternating; the best time and the lowest peak
are kept. Targets (issue 2): >= 0.8x the raw-read throughput, peak RSS <= 1.35x the model.

The fp16 cast streams each tensor from its memory map through one `tensor.to(dtype)` (accelerate's
`set_module_tensor_to_device`): one read of the source, one write of the half-size copy. Alternatives measured
in process on 2 shared cores, two 270 MB shards from the page cache, best of 4: `.to(fp16)` 2.37 GB/s,
`torch.empty(dtype)` + `copy_` 2.39, the same in 4M-element chunks 1.93, `readinto` a reused 16 MiB buffer then
`copy_` 1.16, `readinto` a whole fp32 tensor then cast 0.87. None beats `.to()`, so the loader keeps it; the
"load_file, cast to fp16" row is the same cast done the plain way, for comparison (in one process, best of 3 on
the 1.07 GB model: ours 0.51 s, load_file + `.to` 0.70 s; across child processes the two swing 0.5-2 s on a
shared CPU, so compare several runs).

    python benchmarks/load_raw.py             # ~1.07 GB fp32 model, 4 shards, 2 repeats
    python benchmarks/load_raw.py --gib 2 --repeats 3 --folder /tmp/bench-model
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pipelines

VARIANTS = ("raw read", "safetensors load_file", "load_file, cast to fp16", "ours load_model", "ours, cast to fp16")
WIDTH, FEED_FORWARD = 2048, 8192


def bench_config(depth: int):
    import transformers

    return transformers.T5Config(vocab_size=32, d_model=WIDTH, d_kv=WIDTH // 16, d_ff=FEED_FORWARD, num_layers=depth,
                                 num_heads=16)


def layer_bytes() -> int:
    """One encoder layer in float32: attention's four WIDTH x WIDTH projections, the two feed-forward matrices."""
    return (4 * WIDTH * WIDTH + 2 * WIDTH * FEED_FORWARD) * 4


def model_bytes(depth: int) -> int:
    return depth * layer_bytes()


def save_model(folder: Path, depth: int, shards: int) -> None:
    import transformers

    with torch.device("meta"):  # random init is slow for 1 GB: zeros are as good for IO
        model = transformers.T5EncoderModel(bench_config(depth))
    model.to_empty(device="cpu")
    for parameter in model.parameters():
        nn.init.zeros_(parameter)
    model.save_pretrained(folder, max_shard_size=model_bytes(depth) // shards + 1)


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_child(variant: str, folder: Path) -> dict:
    """In a fresh process: load once, keep everything alive, report seconds and peak RSS above baseline."""
    files = sorted(folder.glob("*.safetensors"))
    if variant.startswith("ours"):  # the owner library and the loader's modules imported before the baseline,
        import transformers  # noqa: F401  as a user's process has them: the load is measured, not the imports
        import pipelines.loading.single_model  # noqa: F401
    baseline = current_rss()
    start = time.perf_counter()
    if variant == "raw read":
        kept = [path.read_bytes() for path in files]
    elif variant == "safetensors load_file":
        from safetensors.torch import load_file

        kept = [load_file(str(path)) for path in files]
        touch(tensor for shard in kept for tensor in shard.values())
    elif variant == "load_file, cast to fp16":  # the plain way to the same result: the floor for our cast
        from safetensors.torch import load_file

        kept = [{name: t.to(torch.float16) for name, t in load_file(str(path)).items()} for path in files]
    else:
        dtype = torch.float16 if "fp16" in variant else None  # a cast makes a real copy of every tensor
        kept = pipelines.load_model(folder, device_map="cpu", torch_dtype=dtype, progress=False)
        touch(kept.state_dict().values())
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    del kept
    return {"seconds": seconds, "peak_over_baseline": peak - baseline}


def touch(tensors) -> None:
    """Read one element per 4 KiB page, so lazily mapped tensors are really in memory."""
    for tensor in tensors:
        flat = tensor.reshape(-1)
        step = max(1, 4096 // tensor.element_size())
        flat[::step].sum().item()


def measure(variant: str, folder: Path) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--folder", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            while handle.read(64 * 1024**2):
                pass


def print_table(results: dict[str, dict], size: int) -> None:
    raw = results["raw read"]
    print(f"\nmodel: {size / 1e9:.2f} GB in {results['_files']} shard(s)\n")
    header = (
        f"{'variant (bytes read/s)':<24}{'time s':>9}{'GB/s':>8}{'x raw speed':>13}"
        f"{'peak RSS GB':>13}{'RSS / model':>13}"
    )
    print(header)
    print("-" * len(header))
    for variant in VARIANTS:
        r = results[variant]
        print(
            f"{variant:<24}{r['seconds']:>9.2f}{size / r['seconds'] / 1e9:>8.2f}"
            f"{raw['seconds'] / r['seconds']:>13.2f}{r['peak_over_baseline'] / 1e9:>13.2f}"
            f"{r['peak_over_baseline'] / size:>13.2f}"
        )
    ours = results["ours load_model"]
    speed, rss = raw["seconds"] / ours["seconds"], ours["peak_over_baseline"] / size
    print(f"\ntargets: >= 0.80x raw speed ({'met' if speed >= 0.8 else 'MISSED'}: {speed:.2f}x), "
          f"peak RSS <= 1.35x model ({'met' if rss <= 1.35 else 'MISSED'}: {rss:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="model size in GiB (>= 1 for the issue's target)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", type=Path, help="reuse/keep the saved model here (default: a temp folder)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--save-child", type=int, nargs=2, metavar=("DEPTH", "SHARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.folder)))
        return
    if args.save_child:
        save_model(args.folder, args.save_child[0], args.save_child[1])
        return
    depth = max(1, round(args.gib * 1024**3 / layer_bytes()))
    scratch = None if args.folder else Path(tempfile.mkdtemp(prefix="load-bench-"))
    folder = args.folder or scratch / "model"
    try:
        if not (folder / "config.json").is_file():
            print(f"saving a {model_bytes(depth) / 1e9:.2f} GB model in {args.shards} shards to {folder} ...")
            command = [sys.executable, __file__, "--save-child", str(depth), str(args.shards), "--folder", str(folder)]
            subprocess.run(command, check=True)
        warm_page_cache(folder)
        results: dict = {"_files": len(list(folder.glob("*.safetensors")))}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                r = measure(variant, folder)
                best = results.setdefault(variant, r)
                best["seconds"] = min(best["seconds"], r["seconds"])
                best["peak_over_baseline"] = min(best["peak_over_baseline"], r["peak_over_baseline"])
        print_table(results, model_bytes(depth))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
