"""Load benchmark (issue 17): our device-mapped load vs diffusers' own `from_pretrained`, on one diffusers folder.

The folder holds an SD1.5-sized `UNet2DConditionModel` (diffusers' SD1.5 UNet config, random weights, 3.44 GB in
float32) saved by diffusers itself in `unet/`, and a `model_index.json` naming it, so that
`pipelines.Pipeline.from_pretrained(folder, device_map=...)` loads it through our loader as a generic pipeline of
one component. It is saved once (by a child process: a child inherits its parent's peak RSS across fork), to a
temp folder or to `--folder` (kept and reused). The files are read once before timing, so every load reads from
the page cache: the comparison is of the loaders, not of the disk.

Each variant loads in a fresh subprocess that imports torch, diffusers and pipelines first (imports are not
timed), then times the load and a touch of one element per memory page of every tensor (safetensors maps tensors
lazily: a load is finished only once its pages are resident), and reports the seconds and its peak RSS above the
RSS before loading; also its CPU seconds (user + system, all threads), steadier than wall time on a shared machine.
Variants alternate within each repeat; the table shows the median and best wall seconds, the median CPU seconds,
and the ratios of medians to diffusers'. Without an accelerator, "balanced" degrades to the CPU (one warning) but still
plans and dispatches: the device-mapped code path; device_map="cpu" is the single-device path (no hooks).

    python benchmarks/load.py                                   # temp folder, 3 repeats
    python benchmarks/load.py --folder /tmp/sd15-unet --repeats 5
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SD15_UNET = {"sample_size": 64, "cross_attention_dim": 768}  # with diffusers' defaults: SD1.5's UNet config
LOADERS = ("diffusers from_pretrained", "ours device_map='balanced'", "ours device_map='cpu'")
DTYPES = ("float32", "bfloat16")


def save_folder(folder: Path) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD15_UNET)
    unet.save_pretrained(folder / "unet")  # one 3.44 GB file: below diffusers' default shard size
    index = {"_class_name": "UNetFolder", "unet": ["diffusers", "UNet2DConditionModel"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_child(loader: str, dtype_name: str, folder: Path) -> dict:
    """In a fresh process: load once, touch every page, report seconds and peak RSS above the baseline."""
    import torch
    from diffusers import UNet2DConditionModel

    from pipelines import Pipeline  # the package face imports lazily: import before timing, as for diffusers

    dtype = None if dtype_name == "float32" else getattr(torch, dtype_name)  # float32: as saved, no cast
    warnings.filterwarnings("ignore", message="No accelerator")
    baseline = current_rss()
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    if loader.startswith("diffusers"):
        model = UNet2DConditionModel.from_pretrained(folder / "unet", torch_dtype=dtype)
    else:
        device_map = loader.split("'")[1]
        model = Pipeline.from_pretrained(folder, device_map=device_map, torch_dtype=dtype, progress=False).unet
    touch(model.state_dict().values())
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu_start
    dtypes = sorted({str(t.dtype) for t in model.parameters()})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_over_baseline": peak - baseline, "dtypes": dtypes}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def touch(tensors) -> None:
    """Read one element per 4 KiB page, so lazily mapped tensors are really in memory."""
    for tensor in tensors:
        flat = tensor.reshape(-1)
        flat[:: max(1, 4096 // tensor.element_size())].float().sum().item()


def measure(loader: str, dtype: str, folder: Path) -> dict:
    command = [sys.executable, __file__, "--child", loader, "--dtype", dtype, "--folder", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(64 * 1024**2):
                    pass


def print_table(results: dict[tuple[str, str], list[dict]], size: int, repeats: int) -> None:
    print(f"\nSD1.5 UNet2DConditionModel, {size / 1e9:.2f} GB float32 on disk, warm page cache, "
          f"{repeats} repeat(s) per variant\n")
    header = (f"{'dtype':<10}{'loader':<29}{'median s':>9}{'best s':>8}{'x diffusers':>12}{'CPU s':>7}"
              f"{'x diffusers':>12}{'peak RSS GB':>12}")
    print(header)
    print("-" * len(header))
    for dtype in DTYPES:
        anchor = {key: statistics.median(r[key] for r in results[(dtype, LOADERS[0])])
                  for key in ("seconds", "cpu_seconds")}
        for loader in LOADERS:
            runs = results[(dtype, loader)]
            wall, cpu = (statistics.median(r[key] for r in runs) for key in ("seconds", "cpu_seconds"))
            best = min(r["seconds"] for r in runs)
            peak = min(r["peak_over_baseline"] for r in runs)
            print(f"{dtype:<10}{loader:<29}{wall:>9.2f}{best:>8.2f}{wall / anchor['seconds']:>12.2f}{cpu:>7.2f}"
                  f"{cpu / anchor['cpu_seconds']:>12.2f}{peak / 1e9:>12.2f}")
    print("\nx diffusers: our median over diffusers' median for the same dtype (<= 1.00: no slower); wall time, then "
          "CPU time.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, help="keep/reuse the saved folder here (default: a temp folder)")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    parser.add_argument("--save-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.dtype, args.folder)))
        return
    if args.save_child:
        save_folder(args.folder)
        return
    scratch = None if args.folder else Path(tempfile.mkdtemp(prefix="load-bench-"))
    folder = args.folder or scratch / "sd15-unet"
    try:
        if not (folder / "model_index.json").is_file():
            print(f"saving an SD1.5 UNet (random weights) to {folder} ...")
            subprocess.run([sys.executable, __file__, "--save-child", "--folder", str(folder)], check=True)
        warm_page_cache(folder)
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            for dtype in DTYPES:
                for loader in LOADERS:
                    results.setdefault((dtype, loader), []).append(measure(loader, dtype, folder))
        size = sum(path.stat().st_size for path in (folder / "unet").glob("*.safetensors"))
        print_table(results, size, args.repeats)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
