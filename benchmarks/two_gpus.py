"""Predicted seconds per call of the real pipelines on two and four GPUs (issue 39): one GPU, today's plan over all
of them, pooled residency, and guidance branches in parallel, on one GPU profile (H100 by default).

    python benchmarks/two_gpus.py --smoke            # sd3-medium and flux1-dev on 2x24 GiB
    python benchmarks/two_gpus.py                    # every real pipeline x 2x16, 2x24, 2x48, 4x24 GiB
    python benchmarks/two_gpus.py --only wan2.1-t2v-14b qwen-image --inventories 2x48 --gpu rtx4090
    python benchmarks/two_gpus.py --estimate         # capture the calls' guidance again (cached in data/)

The pipelines, their call (1024x1024 images, 480x832x49 video, batch 1, 28 steps), their bytes, activations and FLOPs
per run are benchmarks/transfers.py's and benchmarks/time_per_call.py's. How each denoiser runs guidance is learned
by call capture from the pipeline's own `__call__` (`pipelines.hf.calls.guidance`: a batch of two, two calls per step,
or none), with the bytes its inputs and outputs take at that call, kept in data/guidance_calls.json. Qwen-Image is
called with a negative prompt and `true_cfg_scale=4` (its true CFG; without them it runs one branch).

Columns (seconds per call, `plan.seconds_per_call`, one time model):
- one GPU: `placement.plan` with the first GPU only;
- today: every GPU, `guidance_parallel=False` (components spread whole, the denoiser split or streamed);
- pooled: residency pooled over the GPUs (issue 39's other half, another branch): "-" until it is merged;
- guidance: every GPU, `guidance_parallel=True`: the denoiser's branches on two GPUs where both hold it; where it
  does not apply, "n/a" and the plan's reason below the table;
- chosen: what `guidance_parallel=None` (the planner by predicted seconds) picks.
"-": a component computes on the CPU (no GPU time to compare).

Beside them: xDiT's and SGLang's published multi-GPU runs (shared/published_runs, benchmarks/data/published_runs.csv)
of the same pipeline on the same GPU, where there are any.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import warnings
from pathlib import Path

import placement

GiB = 1024**3
DATA = Path(__file__).resolve().parent / "data"
GUIDANCE = DATA / "guidance_calls.json"
PUBLISHED = DATA / "published_runs.csv"
INVENTORIES = {"2x16": [16, 16], "2x24": [24, 24], "2x48": [48, 48], "4x24": [24, 24, 24, 24]}
SMOKE = (("sd3-medium", "flux1-dev"), ("2x24",))
# What a pipeline needs beyond transfers.py's call to run the guidance it is used with.
CALL_EXTRAS = {"qwen-image": {"negative_prompt": " ", "true_cfg_scale": 4.0}}


def guidance_of(key: str, *, video: bool, estimate: bool) -> dict:
    """{denoiser: GuidanceCall} at transfers.py's call, captured once (depth 1: a denoiser's inputs and outputs do
    not depend on its depth) and kept in GUIDANCE."""
    from placement.guidance import GuidanceCall, GuidanceMode

    saved = json.loads(GUIDANCE.read_text())["calls"] if GUIDANCE.exists() else {}
    if key not in saved or estimate:
        import torch
        from real_folders import captured, meta_pipeline
        from transfers import IMAGE_CALL, VIDEO_CALL

        call = {**(VIDEO_CALL if video else IMAGE_CALL), "num_inference_steps": 2, **CALL_EXTRAS.get(key, {})}
        learned = captured(meta_pipeline(key, depth=1), call, dtype=torch.bfloat16).guidance
        saved[key] = {name: {"mode": found.mode.value, "seen": found.seen, "input_bytes": found.input_bytes,
                             "output_bytes": found.output_bytes} for name, found in learned.items()}
        about = ("How each real pipeline's denoiser runs classifier-free guidance at the call of benchmarks/"
                 "transfers.py, learned by call capture (pipelines.hf.calls.guidance) at depth 1, with its floating "
                 "inputs' and outputs' bytes per run (bf16). Written by benchmarks/two_gpus.py (--estimate).")
        GUIDANCE.write_text(json.dumps({"_about": about, "calls": saved}, indent=1, sort_keys=True) + "\n")
    return {name: GuidanceCall(mode=GuidanceMode(entry["mode"]), seen=entry["seen"],
                               input_bytes=entry["input_bytes"], output_bytes=entry["output_bytes"])
            for name, entry in saved[key].items()}


def planned(pipeline, work, guidance, gibs, gpu: str, parallel):
    from transfers import DTYPE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return placement.plan(pipeline.modules, max_memory={**{i: g * GiB for i, g in enumerate(gibs)},
                                                            "cpu": 1024 * GiB},
                              graph=pipeline.edges, dtype=DTYPE, activations=pipeline.activations,
                              runs_per_call=pipeline.runs, gpu=gpu, guidance=guidance, guidance_parallel=parallel,
                              flops_per_run={n: w[0] for n, w in work.items() if n in pipeline.modules},
                              bytes_touched_per_run={n: w[1] for n, w in work.items() if n in pipeline.modules})


def seconds(plan) -> float | None:
    return None if any(c.execution_device == "cpu" for c in plan.components.values()) else plan.seconds_per_call


def run(only, inventories, *, gpu: str, steps: int, estimate: bool) -> None:
    from time_per_call import work_per_run
    from transfers import _is_video, load_pipelines
    from real_folders import PIPELINES

    header = ["pipeline", "GPUs", "one GPU", "today", "pooled", "guidance", "chosen", "mode"]
    rows, reasons = [], []
    for pipeline in load_pipelines(only, steps=steps, estimate=False):
        key = pipeline.name.rstrip("*")
        work = work_per_run(pipeline, estimate=False)
        guidance = guidance_of(key, video=_is_video(PIPELINES[key]["pipeline_class"]), estimate=estimate)
        for label in inventories:
            gibs = INVENTORIES[label]
            one = planned(pipeline, work, guidance, gibs[:1], gpu, False)
            today = planned(pipeline, work, guidance, gibs, gpu, False)
            forced = planned(pipeline, work, guidance, gibs, gpu, True)
            chosen = planned(pipeline, work, guidance, gibs, gpu, None)
            applied = [r for r in forced.guidance_parallel if r.applied]
            modes = ", ".join(sorted({r.mode.value for r in forced.guidance_parallel})) or "not learned"
            picked = "guidance" if any(r.applied for r in chosen.guidance_parallel) else "today"
            rows.append([pipeline.name, label, _cell(seconds(one)), _cell(seconds(today)), "-",
                         _cell(seconds(forced)) if applied else "n/a", picked, modes])
            reasons += [f"{pipeline.name} {label}: {r.summary()}" for r in forced.guidance_parallel if not r.applied]
    print(f"Predicted seconds per call on {gpu} ({steps} steps; one time model, placement.time_model):")
    _table(header, rows)
    if reasons:
        print("\nWhere guidance in parallel does not apply (the plan's reason):")
        for line in dict.fromkeys(reasons):
            print(f"  {line}")
    published(only)


def published(only) -> None:
    """The published multi-GPU runs of these pipelines (xDiT, SGLang), where the CSV has any."""
    names = {"wan": "wan", "flux": "flux", "qwen": "qwen", "sd3": "stable diffusion 3", "hunyuanvideo": "hunyuanvideo",
             "cogvideox": "cogvideox", "pixart": "pixart"}
    with open(PUBLISHED, newline="", encoding="utf-8") as file:
        multi = [row for row in csv.DictReader(file)
                 if any(mark in row["gpu"].lower() for mark in ("2x", "4x", "8x"))
                 or any(word in row["config"].lower() for word in ("cfg", "ulysses", "ring", "usp", "xdit"))]
    wanted = [row for row in multi if any(word in row["pipeline"].lower() for word in names.values())]
    print("\nPublished multi-GPU runs (benchmarks/data/published_runs.csv, from shared/published_runs):")
    if not wanted:
        print("  none of these pipelines: the collected runs hold no xDiT or SGLang CFG-parallel (or other multi-GPU) "
              "measurement of them; the multi-GPU rows there are:")
        wanted = multi
    for row in wanted:
        total = row["seconds_total"] or f"{row['seconds_per_step']} s/step"
        print(f"  {row['system']}: {row['pipeline']} on {row['gpu']}, {row['config']}: {total} s ({row['source_url']})")


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(header, rows) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(w) if i < 2 else str(cell).rjust(w) for i, (cell, w) in
                        enumerate(zip(row, widths))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="pipeline keys (default: every real pipeline)")
    parser.add_argument("--inventories", nargs="*", default=list(INVENTORIES), choices=list(INVENTORIES))
    parser.add_argument("--gpu", default="h100", help="the GPU profile the seconds assume (default h100)")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--estimate", action="store_true", help="capture the guidance again")
    parser.add_argument("--smoke", action="store_true", help="two pipelines on 2x24 GiB")
    args = parser.parse_args(argv)
    import torch
    import transfers

    transfers.DTYPE = torch.bfloat16
    only, inventories = (SMOKE[0], SMOKE[1]) if args.smoke else (args.only, args.inventories)
    run(only, inventories, gpu=args.gpu, steps=args.steps, estimate=args.estimate)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
