"""Replicas per machine on real pipelines: `placement.plan_replicas` vs the naive "one pipeline per GPU or give up"
(diffusers' data-parallel recipe: every process calls `pipe.to(f"cuda:{rank}")`, so a GPU counts only when the
whole pipeline's weights fit on it).

Every pipeline of benchmarks/data/real_pipelines.json (its non-optional components, built on meta from the
published configs with diffusers / transformers, bf16, the execution order as a chain graph; the building is
`placement_quality.load_pipelines`) x the inventories 1x80, 2x24, 4x24, 8x16 and 8x80 GiB. Budgets are used
exactly; the host has 1 TiB of RAM (shared by the replicas), so RAM never decides the count.

Weights only: the plans do not account activations (the real families' call inputs are not modelled here), so
both columns are weight-fits; a 1024x1024 call adds to every replica alike. A replica is "resident" (all
weights on its GPUs) or, only when no group size gives a resident one, "streamed" (weights offloaded to RAM,
executed on the GPUs); the naive count knows only resident single-GPU copies.

A second table does the same with activations, at a common call (1024x1024, one image, classifier-free
guidance), for the presets `sdxl` and `flux` (SDXL base 1.0 and FLUX.1-dev: diffusers' and transformers' classes at
the published configs, on meta): each component's activation peak is estimated on meta (`call_activations`, which
learns each component's inputs from the pipeline's own `__call__`) and the plans add it and the 1 GiB runtime overhead per GPU; the naive count uses the same
memory model for one whole pipeline per GPU (all weights + the largest activation peak + the overhead).

Per pipeline and inventory the tables show our replicas x group size (fit), the naive count, and the ratio of
replicas (ours / naive; "inf" where naive gives up and we do not). Then the time plan_replicas takes.

Run by hand (needs the `[hf]` extra; about a minute, most of it building the models on meta):
    python benchmarks/replicas.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import placement
from placement import ReplicaFit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement_quality import DTYPE, Pipeline, load_pipelines  # noqa: E402  (a sibling script, not a package)
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

GiB = 1024**3
SCENARIOS = PIPELINES_DATA / "real_pipelines.json"
INVENTORIES = {"1x80": [80], "2x24": [24] * 2, "4x24": [24] * 4, "8x16": [16] * 8, "8x80": [80] * 8}
HOST_RAM = 1024 * GiB
SMOKE = ("sd15", "flux1-dev")


CALL = {"height": 1024, "width": 1024}
PRESETS = {"sdxl": "sdxl-base-1.0", "flux": "flux1-dev"}  # the CLI's preset names: the families in data/


def ours(pipeline: Pipeline, gibs: list[int], activations: dict[str, int] | None = None) -> placement.ReplicaPlan:
    budgets = {index: gib * GiB for index, gib in enumerate(gibs)}
    return placement.plan_replicas(
        pipeline.modules, max_memory={**budgets, "cpu": HOST_RAM}, graph=pipeline.edges, dtype=DTYPE,
        activations=activations,
    )


def naive(pipeline: Pipeline, gibs: list[int], activations: dict[str, int] | None = None) -> int:
    """GPUs that hold the whole pipeline (weights, and with activations its largest peak and the overhead)."""
    need = sum(size.total for size in pipeline.sizes.values())
    if activations is not None:
        need += max(activations.values(), default=0) + placement.ACCELERATOR_RUNTIME_OVERHEAD
    return sum(1 for gib in gibs if need <= gib * GiB)


def preset_pipelines() -> list[tuple[Pipeline, dict[str, int]]]:
    """The presets' pipelines on meta with each component's activation peak at CALL."""
    from pipelines.loading.planning import call_activations, modules_and_edges
    from pipelines.presets.real_folders import meta_pipeline
    from placement.sizing import size_module

    found = []
    for name, family in PRESETS.items():
        pipe = meta_pipeline(family)
        modules, edges = modules_and_edges(pipe)
        activations = call_activations(pipe, modules, CALL, torch_dtype=DTYPE)
        sizes = {c: size_module(module, DTYPE) for c, module in modules.items()}
        found.append((Pipeline(name=name, modules=modules, sizes=sizes, edges=edges), activations))
    return found


def _cell(replicas: placement.ReplicaPlan) -> str:
    if not replicas.groups:
        return "0"
    streamed = " streamed" if replicas.fit is ReplicaFit.STREAMED else ""
    return f"{replicas.replicas} x {replicas.group_size} GPU{streamed}"


def _ratio(ours_count: int, naive_count: int) -> str:
    if naive_count == 0:
        return "inf" if ours_count else "-"
    return f"{ours_count / naive_count:.2f}"


def table(pipelines: list[tuple[Pipeline, dict[str, int] | None]], seconds: list[float]) -> None:
    header = ["pipeline", "weights", "inventory", "ours: replicas x group", "naive", "ours/naive"]
    rows = []
    for pipeline, activations in pipelines:
        weights = sum(size.total for size in pipeline.sizes.values()) / GiB
        for label, gibs in INVENTORIES.items():
            start = time.perf_counter()
            replicas = ours(pipeline, gibs, activations)
            seconds.append(time.perf_counter() - start)
            count = naive(pipeline, gibs, activations)
            rows.append([pipeline.name, f"{weights:.2f} GiB", label, _cell(replicas), str(count),
                         _ratio(replicas.replicas, count)])  # fmt: skip
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    more = sum(1 for row in rows if row[5] not in ("-", "1.00"))
    print(f"\nScenarios where we run more replicas than naive: {more} of {len(rows)}; never fewer: "
          f"{all(row[5] in ('-', 'inf') or float(row[5]) >= 1 for row in rows)}.")  # fmt: skip


def run(smoke: bool) -> None:
    seconds: list[float] = []
    print("Real pipelines, weights only (bf16):\n")
    table([(pipeline, None) for pipeline in load_pipelines(SCENARIOS, SMOKE if smoke else None)], seconds)
    print(f"\nReference presets at {CALL['width']}x{CALL['height']}, activations and runtime overhead accounted:\n")
    table(preset_pipelines(), seconds)
    print(f"\nplan_replicas time per scenario: median {sorted(seconds)[len(seconds) // 2]:.2f} s, "
          f"max {max(seconds):.2f} s.")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE)}")
    run(parser.parse_args(argv).smoke)


if __name__ == "__main__":
    main()
