"""Placement quality on real pipelines: our `placement.plan(strategy="balanced")` vs diffusers' own
`_assign_components_to_devices` (what `DiffusionPipeline.from_pretrained(device_map="balanced")` runs).

Every pipeline of `real_pipelines.json` (its non-optional components, built on meta with diffusers /
transformers from the published configs, bf16, execution order as a chain graph) x 12 GPU inventories.
Both planners get the same component sizes (ours, which equal the file's `bytes_loaded_bf16`; the script
checks) and the same GPU budgets, used exactly; the CPU gets 1 TiB, so nothing needs the disk.

Per scenario the table shows, for each planner: the weights it leaves off the GPUs (CPU or offloaded, plus
for diffusers the components it drops from its map), the components missing from the map, the fullest GPU
(weights / budget) and the model-graph edges that cross devices. "fits" says whether the weights fit on
the GPUs at block granularity: a packing of every component's split units (`_no_split_modules` blocks and
the leaves outside them) onto the GPUs exists (first-fit decreasing finds a witness). Then totals, and the
time to plan a FLUX-size pipeline (12B DiT + 4.7B T5 + CLIP + VAE on meta), sizing included.

Then the optimum table (issue 11): per pipeline x inventory, weights only ("w") and with activations ("w+a":
each component's activation peak at one common call -- 1024 x 1024 images, the video families' default
sizes -- from `placement.estimate_activations` on the meta-built components, see `real_calls.py`; kept in
`data/real_activation_peaks.json`, rebuilt with --estimate), the best whole-component map's fullest GPU
(peak / budget, the Plan's memory model: weights + the largest activation executing there + 1 GiB runtime
overhead with activations), found by brute force (`whole_map_oracle.py`), and ours / optimum and diffusers /
optimum for the same score (diffusers' map ignores activations: above 1.00 / optimum past 100% means it
would not fit); the edges crossing devices (ours, diffusers, the fewest among maps within 5% of the optimum);
our planning time. Then the count of scenarios above 1.05 x the optimum.

Run by hand (needs the `[hf]` extra; a few minutes, most of it building the models on meta; --smoke: 2 small
pipelines x 3 inventories, under a minute):
    python benchmarks/placement_quality.py [--scenarios PATH] [--smoke] [--estimate]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import compute_module_sizes
from torch import nn

import placement
from placement.devices import HOST_DEVICES
from placement.sizing import size_module
from quality_optimum import PEAKS, activation_peaks, print_optimum_table
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

GiB = 1024**3
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_SCENARIOS = PIPELINES_DATA / "real_pipelines.json"  # a copy of the shared scenarios, committed
INVENTORIES = {
    "1x24": [24], "2x24": [24, 24], "2x16": [16, 16], "4x16": [16] * 4, "2x12": [12, 12], "2x11": [11, 11],
    "1x80": [80], "2x80": [80, 80], "24+12": [24, 12], "48+24+24": [48, 24, 24], "4x24": [24] * 4,
    "8x16": [16] * 8,
}  # fmt: skip
SMOKE = (("sd15", "pixart-sigma-1024"), ("1x24", "2x11", "24+12"))
DTYPE = torch.bfloat16


@dataclass(frozen=True, kw_only=True)
class Outcome:
    off_gpu: int  # weight bytes not on a GPU (on the CPU, offloaded, on disk, or missing from the map)
    missing: tuple[str, ...]  # components the map does not place at all
    fullest: float  # the fullest GPU: weights / budget
    crossing: int  # model-graph edges whose ends run on different devices
    on_host: bool  # something is on the CPU/disk or missing


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    name: str
    modules: dict[str, nn.Module]  # in execution order
    sizes: dict[str, placement.sizing.ComponentSize]
    edges: list[tuple[str, str]]
    classes: dict[str, str] = None  # component -> class name (real pipelines only)


# --- building the real components on meta (cached: several pipelines share a text encoder or a VAE) ---


_built: dict[tuple, tuple[nn.Module, placement.sizing.ComponentSize]] = {}


def build_component(spec: dict) -> tuple[nn.Module, placement.sizing.ComponentSize]:
    """The component on meta (weights tied after leaving init_empty_weights) and its bf16 size."""
    key = (spec["library"], spec["class"], json.dumps(spec["config"], sort_keys=True))
    if key not in _built:
        cls = _component_class(spec["library"], spec["class"])
        with warnings.catch_warnings(), init_empty_weights():
            warnings.simplefilter("ignore")
            if hasattr(cls, "_keep_in_fp32_modules_strict"):  # a transformers PreTrainedModel
                module = cls(cls.config_class(**spec["config"]))
            else:
                module = cls.from_config(spec["config"])
        if hasattr(module, "tie_weights"):
            module.tie_weights()  # tying inside init_empty_weights() does not stick
        _built[key] = (module, size_module(module, DTYPE))
    return _built[key]


def _component_class(library: str, name: str) -> type:
    found = getattr(importlib.import_module(library), name, None)
    if found is None and library == "diffusers":
        found = getattr(importlib.import_module("diffusers.pipelines.stable_diffusion"), name, None)
    if found is None:
        raise SystemExit(f"{library} has no class {name}; install the [hf] extra at the versions the file names.")
    return found


def load_pipelines(path: Path, only: tuple[str, ...] | None = None) -> list[Pipeline]:
    pipelines = json.loads(path.read_text())["pipelines"]
    result = []
    for name, entry in pipelines.items():
        if only and name not in only:
            continue
        specs = {c: spec for c, spec in entry["components"].items() if not spec["optional"]}
        order = [c for c in entry["execution_order"].split("->") if c in specs]
        order += [c for c in specs if c not in order]
        built = {c: build_component(specs[c]) for c in order}
        for c, (_, size) in built.items():
            if size.total != specs[c]["bytes_loaded_bf16"]:
                print(f"warning: {name}.{c}: sized {size.total} B, the file says {specs[c]['bytes_loaded_bf16']} B")
        result.append(
            Pipeline(
                name=name,
                modules={c: built[c][0] for c in order},
                sizes={c: built[c][1] for c in order},
                edges=list(zip(order, order[1:])),
                classes={c: specs[c]["class"] for c in order},
            )
        )
    return result


# --- the two planners and the yardstick ---


def gpu_budgets(gibs: list[int]) -> dict[int, int]:
    return {index: int(gib * GiB) for index, gib in enumerate(gibs)}


def ours(pipeline: Pipeline, gibs: list[int]) -> Outcome:
    plan = placement.plan(
        pipeline.modules,
        max_memory={**gpu_budgets(gibs), "cpu": 1024 * GiB},
        strategy="balanced",
        graph=pipeline.edges,
        dtype=DTYPE,
        offload_folder="offload",
    )
    off = sum(b for c in plan.components.values() for d, b in c.placed_bytes.items() if d in HOST_DEVICES)
    missing = tuple(c for c in pipeline.modules if c not in plan.components)
    fills = [d.weight_bytes / d.budget for d in plan.devices if isinstance(d.device, int) and d.budget]
    return Outcome(
        off_gpu=off, missing=missing, fullest=max(fills, default=0.0),
        crossing=len(plan.crossing_edges), on_host=off > 0 or bool(missing),
    )  # fmt: skip


def diffusers_assignment(sizes: dict[str, int], budgets: dict[int, int]) -> dict[str, object]:
    """diffusers' `_get_final_device_map` for "balanced", from sizes: components largest first, GPUs
    largest first, then its `_assign_components_to_devices`; returns {component: device}."""
    from diffusers.pipelines.pipeline_loading_utils import _assign_components_to_devices

    by_size = dict(sorted(sizes.items(), key=lambda item: item[1], reverse=True))
    gpus = dict(sorted(budgets.items(), key=lambda item: item[1], reverse=True))
    mapping = _assign_components_to_devices(by_size, gpus, device_mapping_strategy="balanced")
    return {component: device for device, components in mapping.items() for component in components}


def diffusers(pipeline: Pipeline, gibs: list[int]) -> Outcome:
    sizes = {c: s.total for c, s in pipeline.sizes.items()}
    budgets = gpu_budgets(gibs)
    device_map = diffusers_assignment(sizes, budgets)
    missing = tuple(c for c in sizes if c not in device_map)
    off = sum(sizes[c] for c in sizes if device_map.get(c, "cpu") == "cpu")
    used = {d: sum(sizes[c] for c, dev in device_map.items() if dev == d) for d in budgets}
    placed_edges = [(a, b) for a, b in pipeline.edges if a in device_map and b in device_map]
    crossing = sum(1 for a, b in placed_edges if device_map[a] != device_map[b])
    return Outcome(
        off_gpu=off, missing=missing, fullest=max(used[d] / budgets[d] for d in budgets),
        crossing=crossing, on_host=off > 0,
    )  # fmt: skip


def fits_at_block_granularity(pipeline: Pipeline, gibs: list[int]) -> bool:
    """Whether every split unit of every component packs onto the GPUs (first-fit decreasing witness)."""
    room = [gib * GiB for gib in gibs]
    for unit in sorted((u.bytes for s in pipeline.sizes.values() for u in s.split_units), reverse=True):
        slot = next((i for i, left in enumerate(room) if unit <= left), None)
        if slot is None:
            return False
        room[slot] -= unit
    return True


# --- the anchor's known failures, on synthetic components (issue 3's regressions) ---

REGRESSIONS = {
    "6,5,3,3 GiB on 10+7": ([6, 5, 3, 3], [10, 7]),
    "24,9,.25,.17 GiB on 2x24": ([24, 9, 0.25, 0.17], [24, 24]),
    "30 GiB on 2x24": ([30], [24, 24]),
}


class _Block(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel, dtype=DTYPE), requires_grad=False)


class _Synthetic(nn.Module):
    """A component of `gib` GiB in bf16, made of 16 equal never-cut blocks."""

    _no_split_modules = ["_Block"]

    def __init__(self, gib: float):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(int(gib * GiB) // 2 // 16) for _ in range(16))


def synthetic(gibs: list[float]) -> Pipeline:
    with init_empty_weights():
        modules = {f"c{i}": _Synthetic(gib) for i, gib in enumerate(gibs)}
    names = list(modules)
    sizes = {name: size_module(module, DTYPE) for name, module in modules.items()}
    return Pipeline(name="synthetic", modules=modules, sizes=sizes, edges=list(zip(names, names[1:])))


# --- timing ---


def time_flux(pipeline: Pipeline, repeats: int = 5) -> tuple[float, float, float]:
    """Seconds to plan the FLUX-size pipeline over every inventory (sizing included: plan() sizes the meta
    modules itself): our median, diffusers' median (`compute_module_sizes` + assignment), our worst."""
    ours_times, theirs_times = [], []
    for gibs in INVENTORIES.values():
        for _ in range(repeats):
            start = time.perf_counter()
            ours(pipeline, gibs)
            ours_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            sizes = {c: compute_module_sizes(m, dtype=DTYPE)[""] for c, m in pipeline.modules.items()}
            diffusers_assignment(sizes, gpu_budgets(gibs))
            theirs_times.append(time.perf_counter() - start)
    return statistics.median(ours_times), statistics.median(theirs_times), max(ours_times)


# --- the report ---


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def _row(cells, widths) -> str:
    """Names left-aligned, numbers right-aligned."""
    texts = [str(cell) for cell in cells]
    return "  ".join(t.ljust(w) if i < 2 else t.rjust(w) for i, (t, w) in enumerate(zip(texts, widths)))


def run(path: Path, smoke: bool, estimate: bool = False) -> None:
    start = time.perf_counter()
    names, inventories = SMOKE if smoke else (None, tuple(INVENTORIES))
    pipelines = load_pipelines(path, names)
    built = sum(len(p.modules) for p in pipelines)
    print(f"built and sized {built} components on meta in {time.perf_counter() - start:.1f} s\n")
    head = ["pipeline", "GPUs (GiB)", "weights", "fits"]
    head += ["ours off", "miss", "full", "cross", "diff off", "miss", "full", "cross"]
    widths = [18, 10, 8, 5, 9, 5, 6, 6, 9, 24, 6, 6]
    print(_row(["", "", "GiB", "", "GiB", "", "", "", "GiB", "", "", ""], widths))
    print(_row(head, widths))
    rows = []
    for pipeline in pipelines:
        for label in inventories:
            gibs = INVENTORIES[label]
            mine, theirs = ours(pipeline, gibs), diffusers(pipeline, gibs)
            fits = fits_at_block_granularity(pipeline, gibs)
            rows.append((fits, mine, theirs))
            weights = sum(s.total for s in pipeline.sizes.values())
            print(_row([
                pipeline.name, label, _gib(weights), "yes" if fits else "no",
                _gib(mine.off_gpu), len(mine.missing), f"{mine.fullest:.0%}", mine.crossing,
                _gib(theirs.off_gpu), ",".join(theirs.missing) or 0, f"{theirs.fullest:.0%}", theirs.crossing,
            ], widths))  # fmt: skip
    _totals(rows)
    print("\nthe anchor's known failures (synthetic components of 16 blocks each):")
    for label, (components, gpus) in REGRESSIONS.items():
        pipeline = synthetic(components)
        mine, theirs = ours(pipeline, gpus), diffusers(pipeline, gpus)
        print(f"  {label:26} off GPUs / missing: ours {_gib(mine.off_gpu)} GiB / {len(mine.missing)}, "
              f"diffusers {_gib(theirs.off_gpu)} GiB / {len(theirs.missing)} {list(theirs.missing) or ''}")  # fmt: skip
    peaks = activation_peaks(pipelines, rebuild=estimate)
    print_optimum_table(pipelines, {label: INVENTORIES[label] for label in inventories}, peaks,
                        diffusers_map=diffusers_assignment)
    flux = next((p for p in pipelines if p.name == "flux1-dev"), None)
    if flux is not None:
        mine, theirs, worst = time_flux(flux)
        print(f"\nplanning flux1-dev (sizing included), median over {len(INVENTORIES)} inventories x 5: "
              f"ours {mine * 1000:.0f} ms (worst {worst * 1000:.0f} ms, target < 1000 ms), diffusers sizing + "
              f"assignment {theirs * 1000:.0f} ms; ours / diffusers = {mine / theirs:.2f}x")  # fmt: skip
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


def _totals(rows) -> None:
    fitting = [(m, t) for fits, m, t in rows if fits]
    mine_off = sum(m.off_gpu for _, m, _ in rows)
    theirs_off = sum(t.off_gpu for _, _, t in rows)
    print(f"\nscenarios: {len(rows)}; weights fit on the GPUs at block granularity in {len(fitting)}")
    print(f"  of those, something on CPU/disk or dropped: ours {sum(m.on_host for m, _ in fitting)}, "
          f"diffusers {sum(t.on_host for _, t in fitting)}")  # fmt: skip
    print(f"  components missing from the map (all scenarios): ours {sum(len(m.missing) for _, m, _ in rows)}, "
          f"diffusers {sum(len(t.missing) for _, _, t in rows)}")  # fmt: skip
    ratio = f"{mine_off / theirs_off:.2f}x" if theirs_off else "n/a"
    print(f"  weights left off the GPUs (all scenarios): ours {_gib(mine_off)} GiB, diffusers {_gib(theirs_off)} GiB "
          f"(ours / diffusers = {ratio})")  # fmt: skip
    over = sum(1 for _, m, _ in rows if m.fullest > 1.0) + sum(1 for _, _, t in rows if t.fullest > 1.0)
    print(f"  mean fullest GPU: ours {statistics.mean(m.fullest for _, m, _ in rows):.0%}, diffusers "
          f"{statistics.mean(t.fullest for _, _, t in rows):.0%}; over budget anywhere: {over}")  # fmt: skip
    print(f"  edges crossing devices: ours {sum(m.crossing for _, m, _ in rows)}, diffusers "
          f"{sum(t.crossing for _, _, t in rows)} (diffusers: only edges between components it placed)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS, help="real_pipelines.json")
    parser.add_argument("--smoke", action="store_true", help="2 small pipelines x 3 inventories, for a quick check")
    parser.add_argument("--estimate", action="store_true", help=f"re-estimate the activation peaks into {PEAKS.name}")
    args = parser.parse_args(argv)
    if not args.scenarios.exists():
        raise SystemExit(f"{args.scenarios} not found; pass --scenarios PATH to real_pipelines.json.")
    run(args.scenarios, args.smoke, args.estimate)


if __name__ == "__main__":
    sys.exit(main())
