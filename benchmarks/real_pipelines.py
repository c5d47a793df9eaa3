"""Call-aware plans for the real diffusers families vs diffusers' balanced assignment, at a common call.

    python benchmarks/real_pipelines.py             # every family (a few minutes on a 2-core machine)
    python benchmarks/real_pipelines.py --only flux1-dev wan2.1-t2v-14b

Each family is built on meta, at full size, from its published configs (benchmarks/data/real_pipelines.json;
families marked * from benchmarks/data/extra_pipelines.json, written without Hub access) in bf16. The call
is the common one: 1024x1024 images, 480x832x49 video, batch 1, each pipeline's own default guidance and text
length. Activation peaks come from call capture (`pipelines.hf.calls`: the pipeline's own `__call__` run on
stand-ins, each component estimated by `placement.estimate_call` on fake tensors), with the stand-in tokenizers
and schedulers of `real_folders.py`.

For each GPU inventory, two placements and one memory model (ours: weights + the largest activation among
the components executing on the GPU + 1 GiB runtime overhead per used GPU):
- ours: `placement.plan(..., activations=...)`, strategy "balanced" (falls back to split / offload);
- diffusers: `_assign_components_to_devices` (what `from_pretrained(device_map="balanced")` runs), which
  sees weights only; components it sends to the CPU run there.
A cell shows the fullest GPU's predicted peak as a share of its budget, "!" when it is over budget (out of
memory at that call), and where weights left the GPUs ("cpu" / "offl" / "split"). The totals count the
scenarios where each predicts a GPU over budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import placement
from placement.devices import HOST_DEVICES
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD

from pipelines.loading.planning import modules_and_edges
from placement_quality import DTYPE, GiB, diffusers_assignment, gpu_budgets
from real_folders import PIPELINES, captured, meta_pipeline
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

DATA = Path(__file__).resolve().parent / "data"
INVENTORIES = {"1x24": [24], "2x24": [24, 24], "4x24": [24] * 4, "1x48": [48], "2x16": [16, 16],
               "4x16": [16] * 4, "8x16": [16] * 8}  # fmt: skip
IMAGE_CALL = {"height": 1024, "width": 1024, "batch_size": 1}
VIDEO_CALL = {"height": 480, "width": 832, "num_frames": 49, "batch_size": 1}


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str
    pipeline_class: str
    modules: dict  # component -> module on meta, in execution order
    edges: list
    activations: dict[str, int]
    seconds: float  # to estimate every activation


@dataclass(frozen=True, kw_only=True)
class Cell:
    fullest: float  # the fullest GPU's predicted peak / its budget
    over: bool
    where: str  # "" when every weight is on a GPU, else cpu / offl / split


def load_families(only: tuple[str, ...]) -> list[Family]:
    real = json.loads((PIPELINES_DATA / "real_pipelines.json").read_text())["pipelines"]
    families = []
    for key, entry in PIPELINES.items():
        if only and key not in only:
            continue
        name = key if key in real else f"{key}*"
        pipe = meta_pipeline(key)
        modules, edges = modules_and_edges(pipe)  # in execution order, as pipelines run them
        video = any(word in entry["pipeline_class"] for word in ("Video", "Wan", "LTX"))
        started = time.perf_counter()
        activations = dict(captured(pipe, {**(VIDEO_CALL if video else IMAGE_CALL), "num_inference_steps": 1},
                                    dtype=DTYPE).peaks)
        families.append(Family(name=name, pipeline_class=entry["pipeline_class"], modules=modules, edges=edges,
                               activations=activations, seconds=time.perf_counter() - started))
        print(f"  {name}: estimated in {families[-1].seconds:.1f} s", file=sys.stderr)
    return families


def ours(family: Family, gibs: list[int]) -> Cell:
    plan = placement.plan(family.modules, max_memory={**gpu_budgets(gibs), "cpu": 1024 * GiB}, strategy="balanced",
                          graph=family.edges, dtype=DTYPE, offload_folder="offload",
                          activations=family.activations)
    gpus = [d for d in plan.devices if isinstance(d.device, int) and d.budget]
    kinds = {c.kind.value for c in plan.components.values()}
    off = any(d in HOST_DEVICES for c in plan.components.values() for d in c.placed_bytes)
    where = "offl" if off else ("split" if "split" in kinds else "")
    return Cell(fullest=max(d.predicted_peak / d.budget for d in gpus),
                over=any(d.predicted_peak > d.budget for d in gpus), where=where)


def diffusers(family: Family, gibs: list[int]) -> Cell:
    sizes = {c: placement.sizing.size_module(m, DTYPE).total for c, m in family.modules.items()}
    budgets = gpu_budgets(gibs)
    device_map = diffusers_assignment(sizes, budgets)
    shares, over = [], False
    for gpu, budget in budgets.items():
        here = [c for c, d in device_map.items() if d == gpu]
        peak = sum(sizes[c] for c in here) + max((family.activations.get(c, 0) for c in here), default=0)
        peak += ACCELERATOR_RUNTIME_OVERHEAD if here else 0
        shares.append(peak / budget)
        over |= peak > budget
    on_cpu = any(device_map.get(c, "cpu") == "cpu" for c in sizes)
    return Cell(fullest=max(shares), over=over, where="cpu" if on_cpu else "")


def _cell(cell: Cell) -> str:
    return f"{cell.fullest:5.2f}{'!' if cell.over else ' '} {cell.where:<5}"


def run(only: tuple[str, ...]) -> None:
    families = load_families(only)
    print("\nActivation peaks at the common call (bf16, GiB):")
    for family in families:
        peaks = ", ".join(f"{c} {b / GiB:.2f}" for c, b in family.activations.items())
        print(f"  {family.name:<22} {peaks}")
    names = list(INVENTORIES)
    print("\nFullest GPU's predicted peak / budget ('!' over budget); ours | diffusers balanced")
    print(f"{'family':<22}" + "".join(f" | {name:^25}" for name in names))
    totals = {"ours": 0, "diffusers": 0, "both": 0}
    for family in families:
        cells = []
        for name in names:
            mine, theirs = ours(family, INVENTORIES[name]), diffusers(family, INVENTORIES[name])
            totals["ours"] += mine.over
            totals["diffusers"] += theirs.over
            totals["both"] += mine.over and theirs.over
            cells.append(f"{_cell(mine)}|{_cell(theirs)}")
        print(f"{family.name:<22}" + "".join(f" | {cell}" for cell in cells))
    scenarios = len(families) * len(names)
    print(f"\nScenarios with a GPU predicted over budget, of {scenarios}: ours {totals['ours']}, "
          f"diffusers balanced {totals['diffusers']} (both: {totals['both']}).")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="family keys (default: all)")
    run(tuple(parser.parse_args(argv).only))


if __name__ == "__main__":
    main()
