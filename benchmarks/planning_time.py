"""Planning time beyond imports, with and without the block memo (issue 27's target: under 2 s on 2 cores).

    python benchmarks/planning_time.py [N]          # N runs per row and setting (default 3), medians printed
    python benchmarks/planning_time.py 5 --rows cli wan-14b

Each run is a fresh process: it imports torch, diffusers, transformers, placement and pipelines, and
`torch._dynamo`, which torch loads on the first meta or fake op (~3 s on 2 cores, paid by any planner that
estimates activations; the imports' median is printed apart), builds what the row needs outside the clock
(the modules the CLI imports lazily too), then times the row's work: wall seconds and the process's CPU
seconds. The memo is turned off in the child by `PLACEMENT_BLOCK_MEMO=0`; runs alternate on / off, so a
machine whose speed drifts affects both alike, and the ratio is taken per pair of runs (then the median).

Rows (add one by appending a `Row` to `ROWS`: a name, what it measures, and `prepare()` returning the callable
to time):
- cli: `placement plan flux --max-memory 0=24GiB,cpu=64GiB --dtype bf16 --height 1024 --width 1024
  --steps 28`, in-process through `pipelines.cli.main` (the preset: FLUX.1-dev's published configs, built on
  meta; every estimate, every plan it tries); the issue's command with the CPU budget given, so the plan does not depend on the RAM free;
- flux1-dev: the activation estimates alone of FLUX.1-dev's four components built on meta from their real
  configs (benchmarks/data/real_pipelines.json) at 1024x1024, bf16, as `real_calls.py` calls them;
- wan-14b: the estimate of a Wan 2.1 T2V 14B transformer (the config of each of Wan 2.2 A14B's two experts)
  at 480x832x81 (21x60x104 latents, 512 text tokens, guidance's batch of 2), bf16;
- wan-vae: the decode estimate of Wan 2.2 A14B's VAE (AutoencoderKLWan, Wan 2.1's config) at 480x832x81, bf16:
  a causal loop calling its decoder once per latent frame (21 calls), which the memo runs 3 times and replays
  18 (`placement/activations/calls.py`); memo off, every frame runs on fake tensors;
- flux-folder: `Pipeline.plan_placement` of a FLUX.1-dev folder (real configs, full depth; stand-in tokenizers
  and scheduler, `real_folders.py`) for `call={"height": 1024, "width": 1024, "num_inference_steps": 28}` on
  one 24 GiB GPU in bf16: the whole plan, call capture (FluxPipeline's own __call__ on stand-ins) included;
- qwen-folder: the same for a Qwen-Image folder (Qwen2.5-VL 7B text encoder, the 20B MMDiT, its causal VAE)
  at 1024x1024, 50 steps, on one 80 GiB GPU;
- tiny-tiled: `placement plan tiny-flux ... --height 512 --width 512` (issue 41): the tiny preset's VAE
  (diffusers' AutoencoderKL at sample_size 32) tiles with 32-pixel tiles, so the plan estimates a decode of
  hundreds of tiles;
- wan22-folder: the same for a Wan 2.2 A14B folder (two 14B experts switching at boundary_ratio 0.875) at
  480x832x81, 40 steps, on one 80 GiB GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

HERE = Path(__file__).resolve().parent
# The issue's command, with the CPU budget given: detected, it is the RAM free when the benchmark runs (another
# program's use can make the plan fail, or choose another one), so the time would depend on the neighbours.
CLI_ARGS = "plan flux --max-memory 0=24GiB,cpu=64GiB --dtype bf16 --height 1024 --width 1024 --steps 28"
# Issue 41's first-hour command: the tiny preset's VAE decodes 512x512 in tiles of 32 pixels when tiled.
TILED_ARGS = "plan tiny-flux --max-memory 0=1GiB,cpu=64GiB --height 512 --width 512"


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    measures: str
    prepare: Callable[[], Callable[[], object]]  # runs in the child, untimed; returns the work to time


def _cli(arguments: str = CLI_ARGS) -> Callable[[], object]:
    # What the command imports on its way (the CLI defers them so `placement --help` is quick): imports, not
    # planning. Without .pyc files (PYTHONDONTWRITEBYTECODE, as on this project's machines) they cost 0.2-0.4 s.
    from pipelines.cli import advice, targets as resolve, targets  # noqa: F401
    from pipelines.cli import main

    def plan() -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(arguments.split())
        if code != 0:
            raise SystemExit(f"placement {arguments} exited with {code}")
        return code

    return plan


def _estimates(pipeline: str, components: tuple[str, ...]) -> Callable[[], object]:
    import placement
    from placement_quality import build_component
    from real_calls import DTYPE, inputs_for

    real = json.loads((PIPELINES_DATA / "real_pipelines.json").read_text())["pipelines"][pipeline]["components"]
    calls = []
    for name in components:
        module = build_component(real[name])[0].eval()
        calls.append((module, *inputs_for(pipeline, real[name]["class"], module)))

    def estimate() -> list[int]:
        return [placement.estimate_activations(module, args, kwargs, method=method, dtype=DTYPE)
                for module, args, kwargs, method in calls]

    return estimate


def _folder_plan(key: str, call: dict, max_memory: dict, *, experts: int = 1) -> Callable[[], object]:
    import shutil
    import tempfile

    import torch
    from pipelines import Pipeline
    from real_folders import write_folder

    folder = write_folder(Path(tempfile.mkdtemp()) / key, key)
    if experts == 2:  # Wan 2.2 A14B: a second expert of the same config, and the step where it takes over
        shutil.copytree(folder / "transformer", folder / "transformer_2")
        index = json.loads((folder / "model_index.json").read_text())
        index.update(transformer_2=index["transformer"], boundary_ratio=0.875)
        (folder / "model_index.json").write_text(json.dumps(index))

    def plan():
        return Pipeline.plan_placement(folder, max_memory=max_memory, torch_dtype=torch.bfloat16, call=call)

    return plan


ROWS = [
    Row(name="cli", measures=f"placement {CLI_ARGS}", prepare=_cli),
    Row(name="flux1-dev", measures="FLUX.1-dev: CLIP, T5-XXL, transformer, VAE decode estimates (1024x1024)",
        prepare=lambda: _estimates("flux1-dev", ("text_encoder", "text_encoder_2", "transformer", "vae"))),
    Row(name="wan-14b", measures="Wan 2.1 14B transformer estimate (480x832x81, batch 2)",
        prepare=lambda: _estimates("wan2.1-t2v-14b", ("transformer",))),
    Row(name="wan-vae", measures="Wan 2.2 A14B VAE decode estimate (480x832x81: 21 latent frames)",
        prepare=lambda: _estimates("wan2.1-t2v-14b", ("vae",))),
    Row(name="flux-folder", measures="plan_placement of a FLUX.1-dev folder, call 1024x1024, 28 steps (capture)",
        prepare=lambda: _folder_plan("flux1-dev", {"height": 1024, "width": 1024, "num_inference_steps": 28},
                                     {0: "24GiB", "cpu": "64GiB"})),
    Row(name="qwen-folder", measures="plan_placement of a Qwen-Image folder, call 1024x1024, 50 steps (capture)",
        prepare=lambda: _folder_plan("qwen-image", {"height": 1024, "width": 1024, "num_inference_steps": 50},
                                     {0: "80GiB", "cpu": "128GiB"})),
    Row(name="tiny-tiled", measures=f"placement {TILED_ARGS} (32-pixel tiles of the tiny VAE's decode)",
        prepare=lambda: _cli(TILED_ARGS)),
    Row(name="wan22-folder", measures="plan_placement of a Wan 2.2 A14B folder, call 480x832x81, 40 steps (capture)",
        prepare=lambda: _folder_plan("wan2.1-t2v-14b", {"height": 480, "width": 832, "num_frames": 81,
                                                         "num_inference_steps": 40},
                                     {0: "80GiB", "cpu": "128GiB"}, experts=2)),
]


def child(name: str) -> None:
    """One run, in this process: imports, the row's preparation, then the timed work; prints a JSON line."""
    started = time.perf_counter()
    import diffusers  # noqa: F401  (imported as a user's program would, before planning)
    import torch
    import torch._dynamo  # noqa: F401
    import transformers  # noqa: F401

    import pipelines  # noqa: F401
    import placement  # noqa: F401

    imported = time.perf_counter()
    torch.empty(1, device="meta").normal_()  # the first meta op: where torch finishes importing itself
    dynamo = time.perf_counter() - imported
    work = next(row for row in ROWS if row.name == name).prepare()
    timed, cpu = time.perf_counter(), time.process_time()
    work()
    print(json.dumps({"seconds": time.perf_counter() - timed, "cpu": time.process_time() - cpu,
                      "imports": imported - started + dynamo}))


def run_child(name: str, memo: bool) -> dict:
    env = {**os.environ, "PLACEMENT_BLOCK_MEMO": "1" if memo else "0", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True,
                          check=False, cwd=HERE)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"row {name} (memo {'on' if memo else 'off'}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def measure(row: Row, runs: int) -> dict:
    pairs = [(run_child(row.name, memo=True), run_child(row.name, memo=False)) for _ in range(runs)]
    return {
        "on": statistics.median(on["seconds"] for on, _ in pairs),
        "on cpu": statistics.median(on["cpu"] for on, _ in pairs),
        "off": statistics.median(off["seconds"] for _, off in pairs),
        "off cpu": statistics.median(off["cpu"] for _, off in pairs),
        "ratio": statistics.median(off["seconds"] / on["seconds"] for on, off in pairs),
        "imports": statistics.median(run["imports"] for pair in pairs for run in pair),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", type=int, default=3, help="runs per row and setting (median)")
    parser.add_argument("--rows", nargs="+", choices=[row.name for row in ROWS], help="only these rows")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        return child(options.child)
    rows = [row for row in ROWS if not options.rows or row.name in options.rows]
    print(f"Planning seconds beyond imports, median of {options.runs} fresh processes per setting "
          f"({os.cpu_count()} CPUs visible; wall and the process's CPU seconds, the steadier on a shared machine)")
    print(f"{'row':<10} {'memo on':>8} {'(cpu)':>6} {'memo off':>9} {'(cpu)':>6} {'off/on':>7}  {'imports':>7}  measures")
    for row in rows:
        result = measure(row, options.runs)
        print(f"{row.name:<10} {result['on']:>8.2f} {result['on cpu']:>6.2f} {result['off']:>9.2f} "
              f"{result['off cpu']:>6.2f} {result['ratio']:>6.1f}x  {result['imports']:>6.1f}s  {row.measures}",
              flush=True)


if __name__ == "__main__":
    main()
