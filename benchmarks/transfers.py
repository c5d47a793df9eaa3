"""Bytes moved per call when the pipeline does not fit: ours vs diffusers' offloads, a hand-picked mix of them,
the reference policy (`reference_policy.py`) and the lower bound of our memory model.

    python benchmarks/transfers.py                  # every real pipeline x 10 inventories (a few minutes)
    python benchmarks/transfers.py --smoke          # 2 pipelines x 2 inventories, seconds
    python benchmarks/transfers.py --only flux1-dev wan2.1-t2v-14b --inventories 1x24 2x16
    python benchmarks/transfers.py --estimate       # re-estimate the activation peaks (cached in data/)
    python benchmarks/transfers.py --gpu h100       # ours planned for seconds on that profile (issue 38's check)

Pipelines: benchmarks/data/real_pipelines.json and extra_pipelines.json (marked *), built on meta at real
size in bf16 (`placement_quality.build_component`). The call: 1024x1024 images, 480x832x49 video, batch 1,
each family's own guidance and text length; 28 denoising steps (`--steps`), times the denoiser passes per
step of the family (learned from its own `__call__`, call capture: Wan runs guidance as a second pass, so its
transformer runs 56 times). Activation peaks at that call (`placement.estimate_activations` through the family
calls) are kept in data/transfer_activation_peaks.json. Every number is host -> GPU bytes per call in steady
state (the pipeline is called again and again), and seconds at 25 GB/s (PCIe 4.0 x16). The memory model is
the planner's for everyone, and so is the count (`placement.cost.bytes_per_call`: what is loaded once per call
plus runs x what streams per run): a phase holds the resident weights + what the running component brings + its
activations + 1 GiB runtime overhead per GPU in use, within each GPU's budget; "-" where a technique does not
fit (it would run out of memory); "cpu" where our plan has to compute a component on the CPU (a video VAE
decode larger than the GPU, untiled).

What each anchor moves, from its semantics (diffusers 0.42):
- model offload (`enable_model_cpu_offload`): every component is moved whole to the GPU when it runs and back
  when the next one does; `maybe_free_model_hooks` offloads the last one at the end of the call, so each call
  moves every component once: sum of bytes. Fits when the largest component + its activations fit one GPU.
- group offload (`enable_group_offload(offload_type="block_level", use_stream=True)`): every block list's
  blocks (and the rest, one group) move to the GPU at every forward, the next group prefetched: each run
  moves the whole component: sum of runs x bytes. Fits when the rest + two blocks + activations do.
- sequential offload (`enable_sequential_cpu_offload`): accelerate moves each module's own weights at every
  forward: sum of runs x bytes. Fits when the largest module's own weights + activations do.
- by hand: the best a user can pick per component among resident on a GPU (`.to(cuda:i)`), model offload
  onto a GPU (`cpu_offload_with_hook`, chained: a model-offloaded component stays on its GPU until the next
  model-offloaded one runs), and group / sequential offload onto a GPU (same bytes; group where it fits). All
  combinations are tried; the cheapest that fits every phase wins.
- reference: `reference_policy.reference_transfer` (the p_k policy, at block granularity).
- bound: what no plan of the memory model can beat. A component k whose weights exceed the GPUs' room in its
  phase (the best over the m roomiest GPUs of sum(budget - overhead - its activations): a split computes blocks,
  with their activations, on every GPU it spans) streams at least the excess plus its smallest stream buffer at
  every run (`placement.cost.least_streamed_per_run`: forced_k); every byte not resident moves at least once,
  and at most the pooled room less the largest activation peak is resident: bound = sum_k premium(forced_k,
  runs_k) + max(0, weights - resident), the premium being what streaming moves beyond loading once
  (`placement.cost.streaming_premium`: (runs_k - 1) x forced_k).
Ratios are ours / theirs over the scenarios where the pipeline does not fit resident and both fit (< 1: we
move less); the summary gives their median and worst (largest).

Multi-GPU rows (2x8 ... 4x24) are also held to the bound, which pools every GPU's room (issue 39: within 1.5x), and
with `--gpu NAME` their predicted seconds to our plan on one of their GPUs (issue 39: no worse).

With `--gpu NAME` our plan is made for seconds on that GPU profile (FLOPs and bytes touched per run from
data/time_per_call_work.json, as benchmarks/time_per_call.py counts them), and the summary lists every scenario
where it moves more than twice the reference's bytes with the predicted gain over our bytes-only plan, against the
time model's error band (`placement.time_model.ERROR_BAND`): more bytes are only worth a gain beyond the band.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import placement
from placement.cost import bytes_per_call, least_bytes_per_call, least_streamed_per_run, streaming_premium
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from placement.streaming import streaming_working_set, transfer_units
from placement.transfers.blocks import spreadable
from reference_policy import ReferenceComponent, reference_transfer
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

GiB = 1024**3
LINK = 25e9
DATA = Path(__file__).resolve().parent / "data"
PEAKS = DATA / "transfer_activation_peaks.json"
INVENTORIES = {"1x12": [12], "1x16": [16], "1x24": [24], "1x32": [32], "1x48": [48], "2x8": [8, 8],
               "2x12": [12, 12], "2x16": [16, 16], "2x24": [24, 24], "4x24": [24] * 4}  # fmt: skip
IMAGE_CALL = {"height": 1024, "width": 1024, "batch_size": 1}
VIDEO_CALL = {"height": 480, "width": 832, "num_frames": 49, "batch_size": 1}
ANCHOR_ROWS = [("flux1-dev", "1x24"), ("cogvideox-5b", "1x24"), ("hunyuanvideo", "1x32"), ("wan2.1-t2v-1.3b", "1x16"),
               ("wan2.1-t2v-14b", "2x16")]  # fmt: skip
SMOKE = (("wan2.1-t2v-1.3b", "pixart-sigma-1024"), ("1x12", "2x8"))
COLUMNS = ("ours", "model", "group", "sequential", "by hand", "reference", "bound")


@dataclass(frozen=True, kw_only=True)
class Part:
    """One component as the anchors see it (bytes in bf16, activations at the call, runs per call)."""

    name: str
    bytes: int
    activation: int
    runs: int
    working_set: int  # the rest + the blocks in flight: what block-level offloading keeps on the GPU at once
    largest_module: int  # the largest module's own tensors: what sequential offload keeps on the GPU at once
    blocks: tuple[int, ...] = ()  # its blocks' bytes: the least anything streaming it keeps in flight is theirs
    units: tuple = ()
    spreadable: bool = True


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    name: str
    modules: dict  # component -> module on meta, in execution order
    edges: list
    activations: dict[str, int]
    runs: dict[str, int]
    parts: tuple[Part, ...]


# --- the anchors, from their semantics (see the module doc) ---------------------------------------------------


def model_offload(parts, gibs) -> int | None:
    budget = max(gibs) * GiB - ACCELERATOR_RUNTIME_OVERHEAD
    fits = all(p.bytes + p.activation <= budget for p in parts)
    return sum(_loaded(p) for p in parts) if fits else None


def group_offload(parts, gibs) -> int | None:
    budget = max(gibs) * GiB - ACCELERATOR_RUNTIME_OVERHEAD
    fits = all(p.working_set + p.activation <= budget for p in parts)
    return sum(_streamed(p) for p in parts) if fits else None


def sequential_offload(parts, gibs) -> int | None:
    budget = max(gibs) * GiB - ACCELERATOR_RUNTIME_OVERHEAD
    fits = all(p.largest_module + p.activation <= budget for p in parts)
    return sum(_streamed(p) for p in parts) if fits else None


def _loaded(part: Part) -> int:
    """Bytes per call of a component moved whole to the GPU once per call."""
    return bytes_per_call(loaded=part.bytes, streamed=0, runs=part.runs)


def _streamed(part: Part) -> int:
    """Bytes per call of a component moved whole to the GPU at every run."""
    return bytes_per_call(loaded=0, streamed=part.bytes, runs=part.runs)


def by_hand(parts, gibs) -> int | None:
    """The cheapest per-component pick of resident / model offload / streamed, each onto one GPU, that fits."""
    options = [(kind, gpu) for kind in ("resident", "model", "stream") for gpu in range(len(gibs))]
    best = None
    for choice in itertools.product(options, repeat=len(parts)):
        cost = sum(0 if kind == "resident" else _loaded(p) if kind == "model" else _streamed(p)
                   for p, (kind, _) in zip(parts, choice))
        if (best is None or cost < best) and _hand_fits(parts, choice, gibs):
            best = cost
    return best


def _hand_fits(parts, choice, gibs) -> bool:
    """Every phase on every GPU in use: resident weights, the model-offloaded component still loaded (the chain
    offloads it only when the next model-offloaded one runs), the running one's activations and stream room."""
    resident, used = [0] * len(gibs), [False] * len(gibs)
    for p, (kind, gpu) in zip(parts, choice):
        used[gpu] = True
        resident[gpu] += p.bytes if kind == "resident" else 0
    loaded = None
    for p, (kind, gpu) in zip(parts, choice):
        if kind == "model":
            loaded = (gpu, p.bytes)
        own = p.activation + (min(p.working_set, p.largest_module) if kind == "stream" else 0)
        for device, gib in enumerate(gibs):
            held = resident[device] + (loaded[1] if loaded and loaded[0] == device else 0)
            held += own if device == gpu else 0
            if used[device] and held + ACCELERATOR_RUNTIME_OVERHEAD > gib * GiB:
                return False
    return True


def reference(parts, gibs) -> int | None:
    components = [ReferenceComponent(name=p.name, units=p.units, activation=p.activation, runs=p.runs,
                                     spreadable=p.spreadable) for p in parts]
    found = reference_transfer(components, {i: g * GiB for i, g in enumerate(gibs)},
                              overhead=ACCELERATOR_RUNTIME_OVERHEAD)
    return None if found is None else found.total


def bound(parts, gibs) -> int | None:
    pooled = sum(g * GiB - ACCELERATOR_RUNTIME_OVERHEAD for g in gibs)
    forced = 0
    for p in parts:
        streamed = least_streamed_per_run(p.bytes, _phase_room(p, gibs), p.blocks)
        if streamed is None:
            return None  # nothing to stream: it cannot run at all
        forced += streaming_premium(streamed, p.runs)
    resident = max(0, pooled - max(p.activation for p in parts))
    return forced + least_bytes_per_call(max(0, sum(p.bytes for p in parts) - resident))


def _phase_room(part: Part, gibs) -> int:
    """The most of `part` the GPUs can hold in its phase: its activations on every GPU it computes blocks on
    (a split runs each block with the whole sequence there), so on the m roomiest GPUs, the best m (every m, also
    for a component whose layout keeps blocks together: a bound may only be too low)."""
    rooms = sorted((g * GiB - ACCELERATOR_RUNTIME_OVERHEAD - part.activation for g in gibs), reverse=True)
    return max(sum(max(0, room) for room in rooms[:m]) for m in range(1, len(rooms) + 1))


def ours(pipeline: Pipeline, gibs) -> tuple[int | None, float]:
    start = time.perf_counter()
    plan = _plan(pipeline, gibs, GPU)
    seconds = time.perf_counter() - start
    if any(c.execution_device == "cpu" for c in plan.components.values()):
        return None, seconds  # something computes on the CPU: not comparable
    if GPU is not None:
        by_bytes = _plan(pipeline, gibs, None)
        predicted = plan.time_per_call().seconds
        GAINS[(pipeline.name.rstrip("*"), tuple(gibs))] = (1 - predicted / _priced(by_bytes, plan), predicted)
        if len(gibs) > 1:  # the same GPUs, one of them: what the second card buys (issue 39)
            ONE_GPU[(pipeline.name.rstrip("*"), tuple(gibs))] = (predicted, _plan(pipeline, gibs[:1], GPU)
                                                                  .time_per_call().seconds)
    return plan.transfer_bytes_per_call, seconds


def _plan(pipeline: Pipeline, gibs, gpu):
    """Our plan: for bytes (`gpu` None), or for seconds on `gpu` with the pipeline's FLOPs per run."""
    timing = {}
    if gpu is not None:
        work = json.loads((DATA / "time_per_call_work.json").read_text())["work"][pipeline.name.rstrip("*")]
        timing = {"gpu": gpu, "flops_per_run": {n: w[0] for n, w in work.items() if n in pipeline.modules},
                  "bytes_touched_per_run": {n: w[1] for n, w in work.items() if n in pipeline.modules}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return placement.plan(pipeline.modules, max_memory={**{i: g * GiB for i, g in enumerate(gibs)},
                                                            "cpu": 1024 * GiB},
                              graph=pipeline.edges, dtype=DTYPE, activations=pipeline.activations,
                              runs_per_call=pipeline.runs, **timing)


def _priced(plan, timed) -> float:
    """`plan`'s seconds per call with `timed`'s FLOPs and GPU (a bytes-only plan priced as the timed one is)."""
    from placement.time_model import component_time

    return sum(component_time(c.model_copy(update={"flops_per_run": timed.components[n].flops_per_run,
                                                   "bytes_touched_per_run": timed.components[n].bytes_touched_per_run}),
                              timed.gpu, timed.link_bandwidth, timed.disk_read_bandwidth).total_s
               for n, c in plan.components.items())


GPU = None  # --gpu: plan for seconds on this profile
GAINS: dict[tuple, tuple[float, float]] = {}  # (pipeline, GiBs) -> (predicted gain over the bytes-only plan, s)
ONE_GPU: dict[tuple, tuple[float, float]] = {}  # (pipeline, GiBs) -> (our predicted s, the one-GPU plan's s)
POOLED_LIMIT = 1.5  # issue 39: every multi-GPU scenario within this factor of the pooled bound (bytes)


# --- building the pipelines -------------------------------------------------------------------------------------


def load_pipelines(only, *, steps: int, estimate: bool) -> list[Pipeline]:
    from placement_quality import build_component
    from real_folders import PIPELINES, captured, meta_pipeline

    real = json.loads((PIPELINES_DATA / "real_pipelines.json").read_text())["pipelines"]
    peaks = json.loads(PEAKS.read_text())["peaks"] if PEAKS.exists() and not estimate else {}
    found = []
    for key, entry in PIPELINES.items():
        if only and key not in only:
            continue
        name = key if key in real else f"{key}*"
        specs = {c: spec for c, spec in entry["components"].items() if not spec["optional"]}
        declared = entry.get("execution_order", "").split("->")
        order = [c for c in declared if c in specs] + [c for c in specs if c not in declared]
        built = {c: build_component(specs[c]) for c in order}
        modules = {c: module.eval() for c, (module, _) in built.items()}
        if key not in peaks:
            peaks[key] = _estimate(key, entry["pipeline_class"], captured, meta_pipeline)
        # Runs per call do not depend on depth or size: captured at depth 1 and a small call.
        small = dict(SMALL_VIDEO_CALL if _is_video(entry["pipeline_class"]) else SMALL_IMAGE_CALL)
        runs = captured(meta_pipeline(key, depth=1), {**small, "num_inference_steps": steps}).runs or {}
        runs = {c: r for c, r in runs.items() if c in modules}
        parts = tuple(_part(c, modules[c], size, peaks[key].get(c, 0), runs.get(c, 1))
                      for c, (_, size) in built.items())
        found.append(Pipeline(name=name, modules=modules, edges=list(zip(order, order[1:])), activations=peaks[key],
                              runs=runs, parts=parts))
    if estimate or not PEAKS.exists() or any(p.name.rstrip("*") not in _saved() for p in found):
        _save(peaks)
    return found


SMALL_IMAGE_CALL = {"height": 256, "width": 256}
SMALL_VIDEO_CALL = {"height": 64, "width": 64, "num_frames": 9}


def _is_video(pipeline_class: str) -> bool:
    return any(word in pipeline_class for word in ("Video", "Wan", "LTX"))


def _estimate(key: str, pipeline_class: str, captured, meta_pipeline) -> dict[str, int]:
    call = VIDEO_CALL if _is_video(pipeline_class) else IMAGE_CALL
    return dict(captured(meta_pipeline(key), {**call, "num_inference_steps": 1}, dtype=DTYPE).peaks)


def _saved() -> dict:
    return json.loads(PEAKS.read_text())["peaks"] if PEAKS.exists() else {}


def _save(peaks) -> None:
    about = ("Activation peaks (bytes, bf16) of the real pipelines' components at the call of benchmarks/transfers.py "
             "(1024x1024 images, 480x832x49 video, batch 1), by placement.estimate_call through call capture "
             "(pipelines.hf.calls). Written by benchmarks/transfers.py (--estimate rebuilds it).")
    PEAKS.write_text(json.dumps({"_about": about, "peaks": {**_saved(), **peaks}}, indent=1, sort_keys=True) + "\n")


def _part(name, module, size, activation, runs) -> Part:
    units = transfer_units(module, size)
    blocks = tuple(u.bytes for u in units if u.block)
    own = [size.module_sizes.get(path, 0) - sum(size.module_sizes.get(f"{path}.{c}" if path else c, 0)
                                                for c, _ in m.named_children())
           for path, m in module.named_modules()]
    return Part(name=name, bytes=size.total, activation=activation, runs=runs,
                working_set=streaming_working_set(module, size), largest_module=max(own, default=size.total),
                blocks=blocks, units=units,
                spreadable=spreadable(SimpleNamespace(module=module, size=size)))


# --- the table -------------------------------------------------------------------------------------------------


def scenario(pipeline: Pipeline, gibs) -> tuple[dict[str, int | None], float]:
    """Bytes per call of each column (None: does not fit / not comparable), and our planning time."""
    mine, seconds = ours(pipeline, gibs)
    parts = pipeline.parts
    row = {"ours": mine, "model": model_offload(parts, gibs), "group": group_offload(parts, gibs),
           "sequential": sequential_offload(parts, gibs), "by hand": by_hand(parts, gibs),
           "reference": reference(parts, gibs), "bound": bound(parts, gibs)}
    return row, seconds


def _cell(moved: int | None, missing: str = "-") -> str:
    return f"{missing:>15}" if moved is None else f"{moved / GiB:8.1f} {moved / LINK:5.1f}s"


def run(only, inventories, *, steps: int, estimate: bool) -> None:
    pipelines = load_pipelines(only, steps=steps, estimate=estimate)
    print(f"GiB per call and seconds at {LINK / 1e9:g} GB/s, host -> GPU, steady state; {steps} steps "
          "(runs: the denoiser's runs per call)")
    print(f"{'pipeline':<22}{'GPUs':>6}{'runs':>5}  " + "".join(f"{c:>15}" for c in COLUMNS))
    rows, times = {}, []
    for pipeline in pipelines:
        runs = max(pipeline.runs.values(), default=1)
        for label in inventories:
            row, seconds = scenario(pipeline, INVENTORIES[label])
            rows[(pipeline.name.rstrip("*"), label)] = row
            times.append(seconds)
            cells = [_cell(row[c], "cpu" if c == "ours" else "-") for c in COLUMNS]
            print(f"{pipeline.name:<22}{label:>6}{runs:>5}  " + "".join(cells))
    summary(rows, times)


def summary(rows, times) -> None:
    """Ratios ours / theirs where the pipeline does not fit resident (ours moves something, or could not)."""
    moving = {key: row for key, row in rows.items() if row["ours"] != 0}
    on_cpu = sum(row["ours"] is None for row in rows.values())
    print(f"\nOf {len(rows)} scenarios, {len(moving)} do not fit resident ({on_cpu} of them only with a component "
          "computing on the CPU: 'cpu', left out). Ours / theirs (< 1: we move "
          "less) where both fit; against the bound, how far from the least possible (>= 1):")
    print(f"{'vs':<12}{'scenarios':>10}{'median':>10}{'worst':>10}{'ours more':>11}")
    for column in COLUMNS[1:]:
        ratios = [row["ours"] / row[column] for row in moving.values()
                  if row["ours"] is not None and row[column]]
        if ratios:
            worse = sum(r > 1.0 + 1e-9 for r in ratios)
            print(f"{column:<12}{len(ratios):>10}{statistics.median(ratios):>10.3f}{max(ratios):>10.3f}{worse:>11}")
    pooled_check(rows)
    if GPU is not None:
        band_check(rows)
        one_gpu_check()
    print("\nThe issue's anchor rows (GiB per call, seconds at 25 GB/s):")
    for key in ANCHOR_ROWS:
        if key in rows:
            print(f"  {key[0]:<20}{key[1]:>6}  " + "".join(f"{c}: {_cell(rows[key][c]).strip()}  " for c in COLUMNS))
    if times:
        print(f"\nPlanning time (placement.plan, sizing included): median {statistics.median(times) * 1000:.0f} ms, "
              f"max {max(times) * 1000:.0f} ms over {len(times)} scenarios.")


def band_check(rows) -> None:
    """Scenarios where our plan for seconds moves more than twice the reference's bytes, with its predicted gain
    over our bytes-only plan against the error band (module doc)."""
    from placement.time_model import ERROR_BAND

    print(f"\nPlanned for seconds on {GPU}: ours / reference bytes, worst {_worst(rows):.2f}; scenarios moving more "
          f"than 2x the reference's bytes (gain: predicted seconds saved over our bytes-only plan; band "
          f"+-{ERROR_BAND:.0%}):")
    offenders = 0
    for (name, label), row in rows.items():
        if row["ours"] and row["reference"] and row["ours"] > 2 * row["reference"]:
            gain, seconds = GAINS.get((name, tuple(INVENTORIES[label])), (0.0, 0.0))
            offenders += gain <= ERROR_BAND
            print(f"  {name:<20}{label:>6}  {row['ours'] / row['reference']:6.2f}x bytes  gain {gain:6.1%}  "
                  f"({seconds:.1f} s per call){'  <- within the band' if gain <= ERROR_BAND else ''}")
    print(f"  {offenders} scenario(s) move more than 2x the reference's bytes for a gain within the band.")


def pooled_check(rows) -> None:
    """Multi-GPU scenarios that move something: ours against the bound, which pools every GPU's room (issue 39)."""
    pooled = {key: row for key, row in rows.items() if len(INVENTORIES[key[1]]) > 1 and row["ours"] and row["bound"]}
    if not pooled:
        return
    print(f"\nSeveral GPUs, pooled: ours / bound where ours moves something (the bound pools every GPU's room; "
          f"limit {POOLED_LIMIT:g}x):")
    for (name, label), row in pooled.items():
        ratio = row["ours"] / row["bound"]
        print(f"  {name:<20}{label:>6}  {ratio:6.2f}x  ({_cell(row['ours']).strip()} vs {_cell(row['bound']).strip()})"
              f"{'  <- over the limit' if ratio > POOLED_LIMIT else ''}")
    over = sum(row["ours"] / row["bound"] > POOLED_LIMIT for row in pooled.values())
    print(f"  {over} of {len(pooled)} scenario(s) over {POOLED_LIMIT:g}x the bound.")


def one_gpu_check() -> None:
    """Every multi-GPU scenario's predicted seconds against the plan on one of its GPUs (issue 39: no worse)."""
    print(f"\nPredicted seconds per call on {GPU}: ours on the GPUs vs our plan on one of them (issue 39: no worse):")
    worse = 0
    for (name, gibs), (ours_s, one_s) in ONE_GPU.items():
        label = next(k for k, v in INVENTORIES.items() if tuple(v) == gibs)
        flag = ours_s > one_s * (1 + 1e-9)
        worse += flag
        print(f"  {name:<20}{label:>6}  {ours_s:9.1f} s  one GPU {one_s:9.1f} s  ({ours_s / one_s:5.2f}x)"
              f"{'  <- slower than one GPU' if flag else ''}")
    print(f"  {worse} of {len(ONE_GPU)} scenario(s) predicted slower than on one of their GPUs.")


def _worst(rows) -> float:
    ratios = [row["ours"] / row["reference"] for row in rows.values() if row["ours"] and row["reference"]]
    return max(ratios, default=0.0)


def main(argv: list[str] | None = None) -> None:
    global DTYPE, GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="pipeline keys (default: all)")
    parser.add_argument("--inventories", nargs="*", default=list(INVENTORIES), choices=list(INVENTORIES))
    parser.add_argument("--steps", type=int, default=28, help="denoising steps per call (default 28)")
    parser.add_argument("--estimate", action="store_true", help="re-estimate the activation peaks")
    parser.add_argument("--smoke", action="store_true", help="2 pipelines x 2 inventories")
    parser.add_argument("--gpu", default=None, help="plan for seconds on this GPU profile (module doc)")
    args = parser.parse_args(argv)
    import torch

    DTYPE, GPU = torch.bfloat16, args.gpu
    only, inventories = (SMOKE if args.smoke else (tuple(args.only), args.inventories))
    run(tuple(only), list(inventories), steps=args.steps, estimate=args.estimate)


DTYPE = None  # set in main(): torch.bfloat16 (imported there so --help answers without torch)

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
