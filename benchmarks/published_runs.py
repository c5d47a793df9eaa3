"""Published measured runs vs the time model (issue 38): every row of a CSV the library can express, predicted.

    python benchmarks/published_runs.py                 # benchmarks/data/published_runs.csv (the field's runs)
    python benchmarks/published_runs.py other.csv       # any CSV in the same format

The CSV's format is ../shared/published_runs/calibration.csv's (columns: source_url, system, pipeline, gpu, link,
dtype, resolution, steps, config, resident_fraction_or_blocks, seconds_per_step, seconds_total, notes). Each row is
read by the rules below into a pipeline of data/published_pipelines.json (its published configs), a GPU profile, a
call and a placement per component, priced by `placement.price` (placement/pricing.py: the same rules and fitted
constants the planner uses), and printed with the measured seconds, the ratio, whether it is within 20% and, for a
miss, the largest parts of the prediction, what the measurement implies (the copies' speed, or the compute's share
of the rate) and, where the guidance is not stated and two passes a step would fit, that reading (a diagnosis, not
counted). Rows it cannot express are listed with why. The
last line is `N of M expressible rows within 20%`.

Reading a row:
- pipeline: FLUX.1-dev (Flux, FluxPipeline), Qwen-Image, Wan 2.1 14B, Wan 2.2 T2V-A14B and TI2V-5B; "text
  encoder(s)", "VAE decode", "transformer" / "one forward" narrow the row to those components; "denoise" in the
  notes to the denoiser; anything else is the whole call.
- gpu: a profile's name in the text; "80 GB-class" is taken as an H100 (named in the row's assumptions); several
  GPUs, sequence parallelism or no GPU named: not expressible.
- resolution "WxH" or "WxHxNf", "720p", else the pipeline's default call (an assumption, named); steps an integer,
  "1 call" or "one forward" = 1, else the default; passes per step: the pipeline's (2 with classifier-free guidance).
  Resolution and steps both "default" (the source ran the system with its own defaults, its command naming
  neither; "default (not stated)" is a source that does not say): the system's default call where the pipeline's
  entry records one (`system_calls`, with its source: SGLang's Qwen-Image runs guidance by default, two passes).
- config: "no offload" / "resident" / "... off": resident; enable_model_cpu_offload: diffusers' model offload
  (pageable, moved back); enable_sequential_cpu_offload: per tensor, pageable; "group offload (RAM)": blocks
  without streams (pageable); other group offload: with streams (pinned); "low_cpu_mem_usage" (pin per onload):
  group offload with streams that page-locks each block when it loads (`Mode.pin_per_onload`); SGLang's "component cpu_offload" and
  "--text-encoder-cpu-offload": whole component per call (pinned); "layerwise" (SGLang): blocks streamed, prefetch
  and leading resident layers as stated, pinned; "torch.compile": compiled. Dynamic VRAM, disk offload and
  unrecorded resident counts are not expressible.
- system: SGLang runs are priced as SGLang computes (its DiT's fused kernels as `compiled`, FlashAttention-3 on
  Hopper and datacenter Blackwell; its text encoders and VAEs eager) and streams (runtime "engine": no host sync per block); everything else as diffusers does
  (eager SDPA unless the row says torch.compile; runtime "hooks").
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_CSV = DATA / "published_runs.csv"
PIPELINES = DATA / "published_pipelines.json"
BF16_BYTES = 2
WITHIN = 0.2
# Which pipeline a row's `pipeline` text names: first match wins (more specific first).
PIPELINE_NAMES = (
    (r"Qwen-Image-2|MOVA|MiniMax|FLUX\.2", None),
    (r"Wan ?2\.2.*A14B", "wan2.2-t2v-a14b"), (r"Wan ?2\.2.*TI2V-5B", "wan2.2-ti2v-5b"),
    (r"Wan ?2\.1 14B", "wan2.1-t2v-14b"), (r"Qwen-Image", "qwen-image"), (r"FLUX\.1-dev|Flux", "flux1-dev"),
)
GPU_NAMES = ((r"RTX 5090", "rtx5090"), (r"RTX 5060", "rtx5060"), (r"RTX 4090", "rtx4090"), (r"H200", "h200"),
             (r"H100", "h100"), (r"B300", "b300"), (r"B200", "b200"), (r"MI350", "mi350x"), (r"MI300X", "mi300x"),
             (r"L40S", "l40s"), (r"L20", "l20"), (r"A100", "a100-80gb"), (r"RTX PRO 6000", "rtxpro6000"),
             (r"RTX PRO 5000", "rtxpro5000"), (r"RTX 3060 Ti", "rtx3060ti"))
NOT_EXPRESSIBLE_CONFIG = ((r"dynamic VRAM|aimdo|fast-disk|pinned in RAM", "ComfyUI's dynamic VRAM keeps an unstated "
                           "share resident"), (r"offload_to_disk_path", "the drive's read speed is not stated"),
                          (r"best resident|not recorded", "the resident layer count is not recorded"))


@dataclass
class Expressed:
    """A row read into what `placement.price` takes, and what to compare with."""

    key: str
    gpu: str
    call: dict
    scope: list[str]
    modes: dict
    measured: float
    per_step: bool
    assumptions: list[str] = field(default_factory=list)


def read_rows(path: Path) -> list[dict]:
    """The CSV's rows; a row whose resolution says "per repro" takes the frame count its source's repro states."""
    with open(path, newline="") as handle:  # a short row's missing cells read as empty, not None
        rows = [{key: value or "" for key, value in row.items() if key is not None} for row in csv.DictReader(handle)]
    if rows and not {"pipeline", "gpu", "config", "resolution", "steps"} <= set(rows[0]):
        raise SystemExit(f"{path}: not in calibration.csv's format (module doc): columns {', '.join(rows[0])}.")
    repro = {}
    for row in rows:
        found = re.search(r"(\d+) ?frames", row.get("notes") or "")
        if found:
            repro.setdefault(row.get("source_url"), found[1])
    for row in rows:
        if "per repro" in row["resolution"] and not re.search(r"\d+ ?frames", row.get("notes") or ""):
            if row.get("source_url") in repro:
                row["notes"] = f"{row.get('notes') or ''}; {repro[row['source_url']]} frames (the source's repro)"
    return rows


def express(row: dict, pipelines: dict) -> Union[Expressed, str]:
    """The row as a priced placement, or why it cannot be one."""
    from placement.gpu_profiles import gpu_profile
    text = " ".join(row.get(c) or "" for c in ("pipeline", "config", "notes"))
    key = next((k for pattern, k in PIPELINE_NAMES if re.search(pattern, row["pipeline"], re.I)), "")
    if not key:
        return "its pipeline's config is not public or not in data/published_pipelines.json"
    for pattern, reason in NOT_EXPRESSIBLE_CONFIG:
        if re.search(pattern, text, re.I):
            return reason
    gpu, assumptions = _gpu(row["gpu"])
    if gpu is None:
        return assumptions[0]
    measured, per_step = _measured(row)
    runtime = "engine" if re.search(r"SGLang", row.get("system") or "") else "hooks"
    if measured is None:
        return "no single measured number (a range or several runs)"
    entry = pipelines[key]
    call = _call(row, entry["default_call"], assumptions)
    call.update(_system_call(row, entry, assumptions))
    scope = _scope(row, entry)
    modes = {c: {**spec, "runtime": runtime} for c, spec in _modes(row, scope, assumptions).items()}
    if runtime == "engine":  # SGLang's own fused kernels, and FlashAttention-3 where the GPU has it
        attention = "flash3" if gpu_profile(gpu).architecture in ("hopper", "blackwell") else "sdpa"
        modes = {c: {**spec, "compiled": True, "attention": attention} if c == "transformer" else spec
                 for c, spec in modes.items()}
    return Expressed(key=key, gpu=gpu, call=call, scope=scope, modes=modes, measured=measured, per_step=per_step,
                     assumptions=assumptions)


def _gpu(text: str) -> tuple[Optional[str], list[str]]:
    if re.search(r"2x|sp=|\+ \d+x", text):
        return None, ["several GPUs (the time model prices one)"]
    if re.search(r"80 GB-class", text):
        return "h100", ["'80 GB-class' GPU taken as an H100"]
    for pattern, key in GPU_NAMES:
        if re.search(pattern, text):
            return key, []
    return None, ["the GPU is not named"]


def _measured(row: dict) -> tuple[Optional[float], bool]:
    for column, per_step in (("seconds_total", False), ("seconds_per_step", True)):
        value = (row.get(column) or "").strip()
        if re.fullmatch(r"\d+(\.\d+)?", value):
            return float(value), per_step
        if value:
            return None, per_step
    return None, False


def _call(row: dict, default: dict, assumptions: list[str]) -> dict:
    call = dict(default)
    size = re.search(r"(\d{3,4})x(\d{3,4})(?:x(\d+)f)?", row["resolution"])
    if size:
        call.update(width=int(size[1]), height=int(size[2]), frames=int(size[3] or 1 if size[3] else call["frames"]))
        frames = re.search(r"(\d+) ?frames", row.get("notes") or "")
        if not size[3] and frames:
            call["frames"] = int(frames[1])
    elif "720p" in row["resolution"]:
        call.update(height=704 if call["height"] == 704 else 720, width=1280)
        frames = re.search(r"(\d+) ?frames", row.get("notes") or "")
        call["frames"] = int(frames[1]) if frames else call["frames"]
    else:
        assumptions.append(f"call not stated: the default {call['width']}x{call['height']}")
    steps = row["steps"].strip()
    if re.fullmatch(r"\d+", steps):
        call["steps"] = int(steps)
    elif re.search(r"1 call|one forward", steps + row["pipeline"]):
        call["steps"] = 1
    else:
        assumptions.append(f"steps not stated: the default {call['steps']}")
    if re.search(r"one forward|forwards", row["pipeline"]):
        call["passes"] = 1  # a forward is what was timed
    return call


def _system_call(row: dict, entry: dict, assumptions: list[str]) -> dict:
    """What the system's own defaults change in the call, for a row whose source ran them (resolution and steps
    both exactly "default"), from the pipeline entry's `system_calls`; {} otherwise."""
    if not (row["resolution"].strip() == row["steps"].strip() == "default"):
        return {}
    system = row.get("system") or ""
    found = next((spec for name, spec in entry.get("system_calls", {}).items() if name in system), None)
    if found is None:
        return {}
    assumptions.append(f"the system's defaults ran: {found['why']} ({found['source']})")
    return {"passes": found["passes"]}


def _scope(row: dict, entry: dict) -> list[str]:
    name, notes = row["pipeline"], row.get("notes") or ""
    roles = {c: spec["role"] for c, spec in entry["components"].items()}
    if re.search(r"text encoder", name, re.I):
        wanted = {"text"}
    elif re.search(r"VAE decode", name, re.I):
        wanted = {"vae"}
    elif re.search(r"transformer|forward", name, re.I) or re.match(r"denoise", notes):
        wanted = {"denoiser"}
    else:
        wanted = {"text", "denoiser", "vae"}
    return [c for c in entry["order"] if roles[c] in wanted]


def _modes(row: dict, scope: list[str], assumptions: list[str]) -> dict:
    config = row["config"]
    compiled = bool(re.search(r"torch\.compile", config))
    denoiser = [c for c in scope if c == "transformer"] or scope
    text = [c for c in scope if c.startswith("text_encoder")]
    if re.search(r"enable_model_cpu_offload", config):
        return {c: dict(kind="model_offload", pinned=False, back_to_host=True) for c in scope}
    if re.search(r"enable_sequential_cpu_offload", config):
        return {c: dict(kind="sequential", pinned=False) for c in scope}
    if re.search(r"low_cpu_mem_usage", config):  # diffusers' group offload pinning each block as it loads
        return {c: dict(kind="group_streams", pinned=False, pin_per_onload=True, compiled=compiled) for c in denoiser}
    if re.search(r"group offload", config, re.I):
        streams = bool(re.search(r"stream", config))
        if not streams and "(RAM)" not in config:
            streams = True
            assumptions.append("group offload's streams not stated: with streams (its exposed copies are too "
                               "short for synchronous ones)")
        kind = "group_streams" if streams else "group"
        return {c: dict(kind=kind, pinned=streams, compiled=compiled) for c in denoiser}
    modes = {c: dict(kind="resident", compiled=compiled) for c in scope}
    if re.search(r"component cpu_offload", config):
        modes.update({c: dict(kind="model_offload", pinned=True) for c in scope})
    if re.search(r"text-encoder-cpu-offload", config):
        modes.update({c: dict(kind="model_offload", pinned=True) for c in text})
    layerwise = re.search(r"layerwise[-_ ]offload(?! off)(?! \(?false)|layerwise-resident-layers", config)
    if layerwise and not re.search(r"no (DiT )?layerwise|offload off", config):
        resident = re.search(r"resident-layers (\d+)", config)
        prefetch = re.search(r"prefetch (\d+)", config)
        targets = denoiser if re.search(r"dit", config, re.I) else scope
        modes.update({c: dict(kind="layerwise", resident_blocks=int(resident[1]) if resident else 0,
                              prefetch=int(prefetch[1]) if prefetch else 1, compiled=compiled) for c in targets})
    return modes


def component_work(name: str, spec: dict, call: dict, experts: int = 1):
    """`placement.pricing.ComponentWork` of one run of component `name` at `call` (FLOPs by family, module doc)."""
    from placement.pricing import ComponentWork

    frames = call["frames"]
    latent_frames = 1 + (frames - 1) // spec.get("temporal", 4) if frames > 1 else 1
    common = dict(name=name, tensors=spec["tensors"], blocks=max(1, spec["blocks"]))
    if spec["family"] == "vae":
        pixels = call["height"] * call["width"] * frames
        return ComponentWork(**common, weight_bytes=BF16_BYTES * spec["decoder_params"],
                             conv_flops=spec["flops_per_pixel"] * pixels, bytes_touched=spec["bytes_per_pixel"] * pixels,
                             chunks=latent_frames)
    weight = dict(weight_bytes=BF16_BYTES * spec["params"], block_bytes=BF16_BYTES * spec["block_params"])
    if spec["family"] == "encoder":
        d, tokens, layers = spec["d"], spec["tokens"], spec["layers"]
        linear = 2 * d * spec["inner"] + 2 * d * spec["kv"] + spec["ff_mats"] * d * spec["ff"]
        fp32 = d * spec["ff"] if spec.get("fp32_ff_out") else 0  # T5's `wo`, kept in float32 by transformers
        return ComponentWork(**common, **weight, runs=call["passes"], matmul_flops=2 * layers * (linear - fp32) * tokens,
                             fp32_flops=2 * layers * fp32 * tokens,
                             attention_flops=4 * tokens**2 * spec["inner"] * layers)
    image = latent_frames * (call["height"] // spec["patch"]) * (call["width"] // spec["patch"])
    d, layers, text = spec["d"], spec["layers"], spec["text_tokens"]
    if spec["family"] == "mmdit":  # joint attention over image + text; 12 d^2 of linears per token per layer
        tokens = image + text
        matmul, attention = 24 * d**2 * layers * tokens, 4 * tokens**2 * d * layers
    else:  # wan: self-attention over the video, cross-attention to the text
        matmul = 2 * layers * ((6 * d**2 + 2 * d * spec["ff"]) * image + 2 * d**2 * text)
        attention = 4 * layers * d * (image**2 + image * text)
    return ComponentWork(**common, **weight, runs=call["steps"] * call["passes"], matmul_flops=matmul,
                         attention_flops=attention)


def predict(expressed: Expressed, pipelines: dict):
    """`placement.price` of the row: its `CallTime`."""
    from placement.pricing import Mode, price

    entry = pipelines[expressed.key]
    works = [component_work(c, entry["components"][c], expressed.call, entry.get("experts", 1))
             for c in expressed.scope]
    modes = {c: Mode(**spec) for c, spec in expressed.modes.items()}
    return price(works, expressed.gpu, modes)


def why(time, expressed: Expressed, measured_total: float) -> str:
    """What a miss is about: the prediction's largest parts, and what the measurement implies of the one the row
    varies: the copies' speed if compute is right and that speed is one a copy can run at (at least the pageable
    rate), else the compute's share of the peak."""
    from placement.time_model import PAGEABLE_SHARE
    parts = sorted(((c.compute_s or 0.0, f"{c.name} compute {c.compute_s:.2f} s") for c in time.components),
                   reverse=True)
    parts += [(c.exposed_s, f"{c.name} copies {c.exposed_s:.2f} s exposed") for c in time.components if c.exposed_s]
    parts.sort(reverse=True)
    text = "; ".join(label for _, label in parts[:2])
    gap, moved = measured_total - time.compute_s, time.copy_s * time.link_bandwidth
    if time.copy_s and 0 < gap and moved / gap >= PAGEABLE_SHARE * time.link_bandwidth:
        return text + (f"; measured implies the copies ran unhidden at {moved / gap / 1e9:.0f} GB/s "
                       f"(predicted {time.link_bandwidth / 1e9:.0f} GB/s, {time.exposed_s:.1f} s of "
                       f"{time.copy_s:.1f} s exposed)")
    share = time.compute_s / measured_total
    return text + f"; measured implies compute at {share:.2f}x the predicted rate (a call or pass count not stated?)"


def with_guidance(expressed: Expressed, pipelines: dict, measured_total: float) -> str:
    """For a miss whose call runs one pass a step by the pipeline's default: the row priced with classifier-free
    guidance (two passes a step), when the source leaves the guidance unstated and that reading lands within 20%
    (a diagnosis printed beside the miss, never applied to the count)."""
    if expressed.call["passes"] != 1 or expressed.call["steps"] == 1:
        return ""
    doubled = dataclasses.replace(expressed, call={**expressed.call, "passes": 2})
    seconds = predict(doubled, pipelines).seconds
    if abs(seconds / measured_total - 1) > WITHIN:
        return ""
    return (f"; with classifier-free guidance (2 passes a step, not stated) it is {seconds:.2f} s "
            f"({seconds / measured_total:.2f})")


def run(path: Path) -> tuple[int, int]:
    from placement.time_model import short_name
    from placement.gpu_profiles import gpu_profile

    pipelines = json.loads(PIPELINES.read_text())["pipelines"]
    rows = read_rows(path)
    print(f"Published runs in {path} vs placement.price ({len(rows)} rows)")
    print(f"{'#':>3} {'pipeline':<34}{'GPU':<10}{'config':<44}{'predicted':>10}{'measured':>10}{'ratio':>7}  within")
    within, expressed_count, left = 0, 0, []
    for number, row in enumerate(rows, start=1):
        found = express(row, pipelines)
        if isinstance(found, str):
            left.append((number, row, found))
            continue
        time = predict(found, pipelines)
        predicted = time.seconds / (found.call["steps"] if found.per_step else 1)
        ratio = predicted / found.measured
        ok = abs(ratio - 1) <= WITHIN
        within, expressed_count = within + ok, expressed_count + 1
        gpu = short_name(gpu_profile(found.gpu))
        unit = "s/step" if found.per_step else "s"
        print(f"{number:>3} {row['pipeline'][:33]:<34}{gpu[:9]:<10}{row['config'][:43]:<44}{predicted:>9.3f}{unit[0]}"
              f"{found.measured:>9.3f}{unit[0]}{ratio:>7.2f}  {'yes' if ok else 'NO'}")
        total = found.measured * (found.call["steps"] if found.per_step else 1)
        counted = re.search(r"forward", row["pipeline"])  # its passes are the forwards it timed, not a default
        miss = f"miss: {why(time, found, total)}{'' if counted else with_guidance(found, pipelines, total)}"
        details = found.assumptions + ([miss] if not ok else [])
        if details:
            print(f"{'':>4}" + "; ".join(details))
    print(f"\nNot expressible ({len(left)} rows):")
    for number, row, reason in left:
        print(f"{number:>3} {row['pipeline'][:40]:<41}{row['gpu'][:24]:<25}{reason}")
    print(f"\n{within} of {expressed_count} expressible rows within {WITHIN:.0%}")
    return within, expressed_count


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="?", type=Path, default=DEFAULT_CSV, help="published runs (default: the repo's)")
    args = parser.parse_args(argv)
    if not args.csv.is_file():
        raise SystemExit(f"No such CSV file: {args.csv}")
    run(args.csv)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
