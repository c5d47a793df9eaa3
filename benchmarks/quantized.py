"""Quantized and fp8 variants of real pipelines, planned at real size on meta: bytes of each variant vs dense bf16,
and what each does on one 12, 16 or 24 GiB GPU (with 64 GiB of RAM).

    python benchmarks/quantized.py                       # FLUX.1-dev, Qwen-Image, Wan 2.1 T2V 14B
    python benchmarks/quantized.py --only flux1-dev

Each family is written as a configs-only pipeline folder (model_index.json and every component's published
config.json, from benchmarks/data/real_pipelines.json and extra_pipelines.json; no weights) and planned by
`Pipeline.plan_placement` exactly as a load of that folder would be, with the variant as the user would ask for
it: `layerwise_casting={"transformer": torch.float8_e4m3fn}`, or `quantization_config={component: config}` with
diffusers' / transformers' own configs (torchao int8 weight-only, bitsandbytes nf4, quanto int8). The quantized
sizes come from the owners' quantizers preparing the meta model (and torchao/quanto quantizing it on meta), not
from a bytes-per-parameter table. GGUF variants are read from a file's headers, so they need the file: not here.

Columns: the pipeline's planned weight bytes, the ratio to dense bf16, and per GPU inventory the plan's verdict
(fits / offl = fits with offloading / cpu = runs partly on the CPU / none = no plan) with the bytes moved over
the bus per call (`Plan.transfer_bytes_per_call`, at the pipeline's default steps); "plan s": seconds for the
row's four plans (its size and the three GPUs), suggestions included. Weights only (no call): the activation
peaks are the same for every variant and are planned with `call=` in benchmarks/transfers.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
FAMILIES = {"flux1-dev": "real_pipelines.json", "qwen-image": "extra_pipelines.json",
            "wan2.1-t2v-14b": "real_pipelines.json"}
TEXT_ENCODER = {"flux1-dev": "text_encoder_2", "qwen-image": "text_encoder", "wan2.1-t2v-14b": "text_encoder"}
INVENTORIES = {"1x12": 12, "1x16": 16, "1x24": 24}
GiB = 2**30
SHORT = {"fits on accelerators": "fits", "fits with offloading": "offl", "runs partly on the CPU": "cpu",
         "does not fit": "over"}


def write_folder(family: str, root: Path) -> Path:
    """A configs-only diffusers pipeline folder of `family` (its module components only)."""
    spec = json.loads((PIPELINES_DATA / FAMILIES[family]).read_text())["pipelines"][family]
    folder = root / family
    index = {"_class_name": spec["pipeline_class"], "_diffusers_version": "0.42.1"}
    for name, component in spec["components"].items():
        if component.get("optional"):
            continue
        index[name] = [component["library"], component["class"]]
        config = dict(component["config"])
        if component["library"] == "diffusers":
            config["_class_name"] = component["class"]
        else:
            config.setdefault("architectures", [component["class"]])
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text(json.dumps(config))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def variants(family: str) -> dict[str, dict]:
    """Each variant as the keyword arguments a user passes to from_pretrained / plan_placement."""
    import diffusers
    import transformers
    from torchao.quantization import Int8WeightOnlyConfig

    nf4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    encoder = TEXT_ENCODER[family]
    return {
        "dense bf16": {},
        "transformer fp8 layerwise": {"layerwise_casting": {"transformer": torch.float8_e4m3fn}},
        "transformer int8 (torchao)": {"quantization_config": {
            "transformer": diffusers.TorchAoConfig(Int8WeightOnlyConfig())}},
        "transformer int8 (quanto)": {"quantization_config": {"transformer": diffusers.QuantoConfig("int8")}},
        "transformer nf4 (bnb)": {"quantization_config": {"transformer": diffusers.BitsAndBytesConfig(**nf4)}},
        f"transformer + {encoder} nf4": {"quantization_config": {
            "transformer": diffusers.BitsAndBytesConfig(**nf4), encoder: transformers.BitsAndBytesConfig(**nf4)}},
    }


def plan(folder: Path, gib: int | None, options: dict):
    import pipelines

    budgets = {0: f"{gib}GiB", "cpu": "64GiB"} if gib else {0: "1000GiB", "cpu": "64GiB"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipelines.Pipeline.plan_placement(folder, max_memory=budgets, torch_dtype=torch.bfloat16, **options)


def cell(folder: Path, gib: int, options: dict) -> str:
    from placement.errors import PlacementError

    try:
        result = plan(folder, gib, options)
    except PlacementError:
        return "none"
    return f"{SHORT[result.verdict.kind.value]} {result.transfer_bytes_per_call / GiB:.1f}G"


def rows(family: str, root: Path) -> list[list[str]]:
    folder = write_folder(family, root)
    table, dense = [], None
    for name, options in variants(family).items():
        started = time.perf_counter()
        total = sum(component.bytes for component in plan(folder, None, options).components.values())
        dense = dense or total
        cells = [cell(folder, gib, options) for gib in INVENTORIES.values()]
        seconds = time.perf_counter() - started
        table.append([family, name, f"{total / GiB:.2f}", f"{total / dense:.2f}", *cells, f"{seconds:.0f}"])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args(argv)
    header = ["family", "variant", "GiB", "x dense", *[f"{name} (moved/call)" for name in INVENTORIES], "plan s"]
    table = [header]
    with tempfile.TemporaryDirectory() as root:
        for family in args.only:
            table += rows(family, Path(root))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths)))
    print("\nGiB: planned weight bytes of the whole pipeline; x dense: ratio to dense bf16; fits / offl / cpu: the "
          "plan's verdict on one GPU of that size with 64 GiB of RAM (none: no plan); moved/call: host->GPU bytes "
          "per call in steady state; plan s: seconds for the row's four plans.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
