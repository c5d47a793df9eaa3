"""`placement plan TARGET --max-memory 0=24GiB,1=24GiB`: where a pipeline would go, without loading weights.

TARGET is a preset name (flux, sdxl, ...: the real pipeline's published configs; tiny-flux, tiny-sd15: tiny configs;
all diffusers' and transformers' classes built on meta), a pipeline folder, or a Hub id (only model_index.json and the configs
are downloaded). `--height/--width` (with `--batch-size`, `--num-images-per-prompt`, `--guidance-scale`, and for
diffusers pipelines `--num-frames`, `--max-sequence-length`) plan for that call: each component's activation
peak, and per device weights + activations + overhead; `--steps` is how often the denoiser runs per call, of
which `--strength` runs a share in pipelines that start from an image (img2img, inpaint).
Budgets: --max-memory 0=24GiB,1=24GiB,cpu=64GiB, or 2x24GiB for two of one size. With a call, the plan predicts
the seconds per call (compute, copies and the copies compute does not hide) on --gpu NAME (rtx4090, h100, ...),
by default on this machine's GPU, else on a stated default. The plan opens with its
verdict; what would do better follows it (bf16 when the plan is in fp32, a CPU budget detected on this
machine). --svg FILE draws it, --json FILE saves it (Plan.from_json reads it back), --timeline FILE writes the
predicted call as a Chrome trace (Perfetto opens it; hooks.trace_calls() records a real call in the same format);
FILE "-" is stdout (the table then goes to stderr, so that stdout is the JSON, SVG or trace alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import (add_call_arguments, add_guidance_parallel_argument, budgets_arg, call_spec, dtype_arg,
                   guidance_parallel_arg, layerwise_casting_arg, output_arg, path_problem, refused, strategy_arg,
                   target_problem, write_text)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a pipeline's placement without loading weights",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a preset (flux, sdxl, sd35-large, tiny-flux, ...; see the README), a folder or a Hub id")
    parser.add_argument("--max-memory", type=budgets_arg, default=None, metavar="BUDGETS",
                        help="budgets, e.g. 0=24GiB,1=24GiB,cpu=64GiB or 2x24GiB (default: detect this machine's)")
    parser.add_argument("--strategy", type=strategy_arg, default="balanced",
                        help="balanced (default), sequential, balanced_low_0, auto, a device, or a JSON dict")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: as saved)")
    parser.add_argument("--offload-folder", type=Path, default=None, help="allow disk offload into this folder")
    parser.add_argument("--layerwise-casting", type=layerwise_casting_arg, default=None, metavar="COMPONENT=DTYPE",
                        help="store a component's Linear/Conv weights in fp8, e.g. transformer=fp8_e4m3fn (folders)")
    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help="the GPU the predicted seconds per call assume, e.g. rtx4090, h100, a100-80gb "
                             "(default: this machine's, else a stated default; a wrong name lists the known ones)")
    add_guidance_parallel_argument(parser)
    add_call_arguments(parser)
    parser.add_argument("--json", type=output_arg, default=None, metavar="FILE",
                        help="also write the plan as JSON ('-': to stdout)")
    parser.add_argument("--svg", type=output_arg, default=None, metavar="FILE",
                        help="also draw the plan as an SVG picture ('-': to stdout)")
    parser.add_argument("--timeline", type=output_arg, default=None, metavar="FILE",
                        help="also write the predicted call as a Chrome trace JSON, for Perfetto ('-': to stdout)")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    outputs = {"--json": args.json, "--svg": args.svg, "--timeline": args.timeline}
    to_stdout = [flag for flag, path in outputs.items() if path == "-"]
    if len(to_stdout) > 1:
        args.parser.error(f"{' and '.join(f'{flag} -' for flag in to_stdout)} would all write to stdout; send all "
                          "but one of them to a file.")
    early = refused(args, output_problem(args) or target_problem(args.target))  # before torch loads (seconds)
    if early is not None:
        return early

    from .advice import plan_with_advice
    from .targets import (TargetPlanner, complete_call, in_flag_names, preset_summary, resolve_budgets_arg,
                          warnings_once)

    report = sys.stderr if to_stdout else sys.stdout  # stdout carries the JSON, SVG or trace alone
    example = args.max_memory.text if args.max_memory is not None else "0=24GiB"
    args.gpu = checked_gpu(args)
    with warnings_once() as printed_anyway:
        max_memory = resolve_budgets_arg(args.max_memory, "--max-memory")
        planner = TargetPlanner(target=args.target, device_map=args.strategy, max_memory=max_memory,
                                offload_folder=args.offload_folder, call=call_spec(args),
                                layerwise_casting=args.layerwise_casting, gpu=args.gpu,
                                guidance_parallel=guidance_parallel_arg(args))
        defaulted = complete_call(planner)
        plan, advice = plan_with_advice(planner, dtype=args.dtype, max_memory=max_memory, budgets_example=example,
                                        suggest_gpus=True)
        printed_anyway += plan.warnings  # explain() lists them: do not print them twice
    summary = preset_summary(args.target)
    if summary is not None:  # which real classes a preset's name stands for
        print(summary, file=report)
    if planner.call is not None:  # what the activation peaks below are for
        said = ", ".join(f"{key}={value}" for key, value in planner.call.items())
        default = f" ({' and '.join(defaulted)}: the pipeline's default)" if defaulted else ""
        print(f"Planned for the call: {said}{default}\n", file=report)
    print(in_flag_names(plan.explain()), file=report)
    for line in [*planner.notes, *advice]:
        print(f"\nhint: {in_flag_names(line)}", file=report)
    if args.json is not None:
        write_text(args.json, plan.to_json())
        print(f"\nPlan written to {_named(args.json)} (schema_version {plan.schema_version}; Plan.from_json reads it)",
              file=report)
    if args.svg is not None:
        write_text(args.svg, plan.to_svg())
        print(f"Plan picture written to {_named(args.svg)} (open it in a browser)", file=report)
    if args.timeline is not None:
        _write_timeline(args.timeline, plan, report)
    return 0


def _write_timeline(path, plan, report) -> None:
    """--timeline FILE: the predicted call (`Plan.timeline()`); without a call only bytes are known, said so."""
    write_text(path, json.dumps(plan.timeline()))
    known = "" if plan.seconds_per_call is not None else " (no call planned: copies only, compute not known)"
    print(f"Predicted timeline written to {_named(path)}{known} (open it in https://ui.perfetto.dev)", file=report)


def checked_gpu(args: argparse.Namespace) -> str | None:
    """--gpu NAME: a known GPU profile's key, or argparse's one-line error naming the known ones, closest first.
    Checked when the command runs, not while parsing: the profiles live in `placement`, which imports torch, and
    help and argument errors answer without it."""
    from placement.errors import PlanError
    from placement.gpu_profiles import gpu_profile

    if args.gpu is None:
        return None
    try:
        return gpu_profile(args.gpu).key
    except PlanError as error:
        args.parser.error(str(error).replace("gpu=", "--gpu "))


def output_problem(args: argparse.Namespace) -> str | None:
    """Why --json, --svg, --timeline or --offload-folder cannot be written, or None: said before the plan (and
    before torch loads), not after it."""
    problems = [path_problem(args.json, flag="--json", folder=False), path_problem(args.svg, flag="--svg", folder=False),
                path_problem(args.timeline, flag="--timeline", folder=False),
                path_problem(args.offload_folder, flag="--offload-folder", folder=True)]
    return next(filter(None, problems), None)


def _named(path) -> str:
    return "stdout" if path == "-" else str(path)
