"""`placement plan TARGET --max-memory 0=24GiB,1=24GiB`: where a pipeline would go, without loading weights.

TARGET is a preset name (built on meta), a pipeline folder, or a Hub id (only model_index.json and the configs
are downloaded). `--height/--width` (with `--batch-size`, `--num-images-per-prompt`, `--guidance-scale`, and for
diffusers pipelines `--num-frames`, `--max-sequence-length`) plan for that call: each component's activation peak, and per device weights + activations + overhead.
Budgets: --max-memory 0=24GiB,1=24GiB,cpu=64GiB, or 2x24GiB for two of one size. The plan opens with its
verdict; --svg FILE draws it, --json FILE saves it (Plan.from_json reads it back).
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from .args import (
    add_call_arguments, budgets_arg, call_spec, dtype_arg, layerwise_casting_arg, strategy_arg, torch_dtype, write_text,
)

if TYPE_CHECKING:  # imported when the command runs: `placement --help` must not import torch
    from placement import Plan


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a pipeline's placement without loading weights",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a preset (tiny-unet, tiny-dit, sdxl-like, flux-like), a folder or a Hub id")
    parser.add_argument("--max-memory", type=budgets_arg, default=None, metavar="BUDGETS",
                        help="budgets, e.g. 0=24GiB,1=24GiB,cpu=64GiB or 2x24GiB (default: detect this machine's)")
    parser.add_argument("--strategy", type=strategy_arg, default="balanced",
                        help="balanced (default), sequential, balanced_low_0, auto, a device, or a JSON dict")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: as saved)")
    parser.add_argument("--offload-folder", type=Path, default=None, help="allow disk offload into this folder")
    parser.add_argument("--layerwise-casting", type=layerwise_casting_arg, default=None, metavar="COMPONENT=DTYPE",
                        help="store a component's Linear/Conv weights in fp8, e.g. transformer=fp8_e4m3fn (folders)")
    add_call_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the plan as JSON")
    parser.add_argument("--svg", type=Path, default=None, metavar="FILE", help="also draw the plan as an SVG picture")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    from .resolve import in_flag_names, resolve_budgets_arg, warnings_once

    call = call_spec(args, args.parser)
    max_memory = resolve_budgets_arg(args.max_memory, "--max-memory")
    with warnings_once() as printed_anyway:
        plan = plan_target(args.target, device_map=args.strategy, max_memory=max_memory,
                           torch_dtype=torch_dtype(args.dtype), offload_folder=args.offload_folder, call=call,
                           layerwise_casting=args.layerwise_casting)
        printed_anyway += plan.warnings  # explain() lists them: do not print them twice
    if call is not None:  # what the activation peaks below are for
        print("Planned for the call: " + ", ".join(f"{key}={value}" for key, value in call.items()) + "\n")
    print(in_flag_names(plan.explain()))
    if args.json is not None:
        write_text(args.json, plan.to_json())
        print(f"\nPlan written to {args.json} (schema_version {plan.schema_version}; Plan.from_json reads it)")
    if args.svg is not None:
        write_text(args.svg, plan.to_svg())
        print(f"Plan picture written to {args.svg} (open it in a browser)")
    return 0


def plan_target(target: str, *, device_map, max_memory, torch_dtype, offload_folder, call,
                layerwise_casting=None) -> Plan:
    from ..loading.planning import plan_pipeline
    from ..text_to_image.pipeline import TextToImagePipeline
    from ..text_to_image.presets import PRESETS

    if target in PRESETS:
        if layerwise_casting:
            from .resolve import CliArgumentError
            raise CliArgumentError(f"--layerwise-casting plans a saved folder; save the {target} preset first.")
        pipe = TextToImagePipeline.from_preset(target, device="meta")
        return plan_pipeline(pipe, device_map=device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                             offload_folder=offload_folder, call=call, pinned={})
    folder = target_folder(target)
    return pipeline_class_of(folder).plan_placement(folder, device_map=device_map, max_memory=max_memory,
                                                    torch_dtype=torch_dtype, offload_folder=offload_folder,
                                                    call=call, layerwise_casting=layerwise_casting)


def pipeline_class_of(folder: Path) -> type:
    """The folder's own pipeline class when it is one of ours (so call= works), else the generic Pipeline."""
    import pipelines

    from ..folder.model_index import ModelIndex
    from ..framework.pipeline import Pipeline

    found = getattr(pipelines, ModelIndex.read(folder).class_name, None)
    return found if isinstance(found, type) and issubclass(found, Pipeline) else Pipeline


def target_folder(target: str) -> Path:
    """TARGET as a local folder (a Hub id: its configs downloaded); not found: what TARGET may have meant."""
    from ..folder.sources import resolve_pipeline_folder
    from ..text_to_image.presets import PRESETS
    from .resolve import PlanTargetError

    if Path(target).exists():
        return resolve_pipeline_folder(target, weights=False)
    try:
        return resolve_pipeline_folder(target, weights=False)
    except Exception as error:  # the Hub (or the network) said no: say what TARGET may be
        close = difflib.get_close_matches(target, PRESETS, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        raise PlanTargetError(
            f"{target!r} is not a preset ({', '.join(PRESETS)}{guess}). {type(error).__name__}: {error}"
        ) from error
