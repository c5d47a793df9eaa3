"""The optimum table of `placement_quality.py` (issue 11): ours and diffusers' balanced map against the best
whole-component map, weights only and with activation peaks at a common call. See that script's doc."""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

import placement
from whole_map_oracle import TOLERANCE, Optimum, crossings, oracle, shares

GiB = 1024**3
PEAKS = Path(__file__).resolve().parent / "data" / "real_activation_peaks.json"
DTYPE = torch.bfloat16


@dataclass(frozen=True, kw_only=True)
class Scored:
    ours: float  # our fullest GPU share (inf: not every component whole on a GPU)
    theirs: float  # diffusers' map under the same memory model (inf: something on the CPU)
    optimum: Optional[Optimum]
    ours_crossing: int
    theirs_crossing: int
    seconds: float


def activation_peaks(pipelines, *, rebuild: bool) -> dict[str, dict[str, int]]:
    """{pipeline: {component: bytes}}: from the committed file, or estimated now (`real_calls`) and written."""
    known = json.loads(PEAKS.read_text())["peaks"] if PEAKS.exists() else {}
    missing = [p for p in pipelines if rebuild or p.name not in known]
    if missing:
        from real_calls import __doc__ as call_doc, estimate

        for pipeline in missing:
            start = time.perf_counter()
            known[pipeline.name] = {
                c: estimate(pipeline.name, pipeline.classes[c], module) for c, module in pipeline.modules.items()
            }
            print(f"estimated {pipeline.name}'s activation peaks in {time.perf_counter() - start:.0f} s")
        about = call_doc.split("\n\n")[0] + " Written by placement_quality.py --estimate."
        PEAKS.write_text(json.dumps({"_about": about, "peaks": known}, indent=1) + "\n")
    return {p.name: known[p.name] for p in pipelines}


def score(pipeline, gibs, activations, *, accounted: bool, diffusers_map: Callable) -> Scored:
    budgets = {i: int(gib * GiB) for i, gib in enumerate(gibs)}
    weights = {c: s.total for c, s in pipeline.sizes.items()}
    activations = activations if accounted else {}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = placement.plan(
            pipeline.modules, max_memory={**budgets, "cpu": 1024 * GiB}, graph=pipeline.edges, dtype=DTYPE,
            offload_folder="offload", activations=activations if accounted else None,
        )
    seconds = time.perf_counter() - start
    whole = all(c.kind is placement.PlacementKind.WHOLE for c in plan.components.values())
    ours = max(d.predicted_peak / d.budget for d in plan.devices if isinstance(d.device, int)) if whole else float("inf")
    theirs_map = diffusers_map(weights, budgets)
    on_gpus = all(isinstance(theirs_map.get(c), int) for c in weights)
    theirs = max(shares(theirs_map, weights, activations, budgets, accounted=accounted).values()) if on_gpus else float("inf")
    return Scored(
        ours=ours, theirs=theirs, optimum=oracle(weights, activations, budgets, pipeline.edges, accounted=accounted),
        ours_crossing=len(plan.crossing_edges), theirs_crossing=crossings(theirs_map, pipeline.edges), seconds=seconds,
    )


def print_optimum_table(pipelines, inventories: Mapping[str, list], peaks, *, diffusers_map: Callable) -> None:
    print("\noptimum: the best whole-component map's fullest GPU (peak / budget); ours and diffusers as x optimum")
    head = ("pipeline", "GPUs", "mode", "optimum", "ours/opt", "diff/opt", "cross ours", "diff", "fewest", "plan ms")
    widths = (18, 9, 4, 8, 9, 9, 10, 5, 7, 8)
    print("  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    rows = []
    for pipeline in pipelines:
        for label, gibs in inventories.items():
            for accounted in (False, True):
                scored = score(pipeline, gibs, peaks[pipeline.name], accounted=accounted, diffusers_map=diffusers_map)
                rows.append((accounted, scored))
                best = scored.optimum
                cells = [pipeline.name, label, "w+a" if accounted else "w"]
                cells += ["no fit", "", "", "", "", ""] if best is None else [
                    f"{best.share:.0%}", _ratio(scored.ours, best.share), _ratio(scored.theirs, best.share),
                    scored.ours_crossing, scored.theirs_crossing, best.fewest_crossings,
                ]  # fmt: skip
                cells.append(f"{scored.seconds * 1000:.0f}")
                print("  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    _optimum_totals(rows)


def _ratio(value: float, best: float) -> str:
    return "off GPU" if value == float("inf") else f"{value / best:.3f}"


def _optimum_totals(rows) -> None:
    for accounted in (False, True):
        feasible = [s for a, s in rows if a is accounted and s.optimum is not None]
        if not feasible:
            continue
        over = lambda value, s: value > s.optimum.share * (1 + TOLERANCE) + 1e-9  # noqa: E731
        worst = lambda values: max(values, default=float("nan"))  # noqa: E731
        print(
            f"  {'with activations' if accounted else 'weights only'}: {len(feasible)} feasible scenarios; above "
            f"{1 + TOLERANCE:.2f} x optimum: ours {sum(over(s.ours, s) for s in feasible)}, diffusers "
            f"{sum(over(s.theirs, s) for s in feasible)}; worst ours/opt {worst(s.ours / s.optimum.share for s in feasible):.3f}, "
            f"diffusers/opt {worst(s.theirs / s.optimum.share for s in feasible):.3f} (inf: off the GPUs); crossings: "
            f"ours {sum(s.ours_crossing for s in feasible)}, diffusers {sum(s.theirs_crossing for s in feasible)}, "
            f"fewest within {TOLERANCE:.0%} {sum(s.optimum.fewest_crossings for s in feasible)}"
        )  # fmt: skip
    times = [s.seconds for _, s in rows]
    print(f"  plan time (sizing included): median {statistics.median(times) * 1000:.0f} ms, worst {max(times) * 1000:.0f} ms")
