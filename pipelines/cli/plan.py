"""`placement plan TARGET --max-memory 0=24GiB,1=24GiB`: where a pipeline would go, without loading weights.

TARGET is a preset name (built on meta), a pipeline folder, or a Hub id (only model_index.json and the configs
are downloaded). `--height/--width` (with `--batch-size`, `--num-images-per-prompt`, `--guidance-scale`, and
for diffusers pipelines `--num-frames`, `--max-sequence-length`) plan for that call: each component's activation peak, and per device weights + activations + overhead.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from placement import Plan
from placement.errors import PlacementError

from .args import call_spec, dtype_arg, max_memory_arg, strategy_arg, write_json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a pipeline's placement without loading weights",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a preset (tiny-unet, tiny-dit, sdxl-like, flux-like), a folder or a Hub id")
    parser.add_argument("--max-memory", type=max_memory_arg, default=None,
                        help="budgets, e.g. 0=24GiB,1=24GiB,cpu=64GiB (default: detect this machine's)")
    parser.add_argument("--strategy", type=strategy_arg, default="balanced",
                        help="balanced (default), sequential, balanced_low_0, auto, a device, or a JSON dict")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: as saved)")
    parser.add_argument("--offload-folder", type=Path, default=None, help="allow disk offload into this folder")
    parser.add_argument("--height", type=int, default=None, help="plan for a call at this image height")
    parser.add_argument("--width", type=int, default=None, help="plan for a call at this image width")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per call (with --height/--width)")
    parser.add_argument("--num-images-per-prompt", type=int, default=None,
                        help="images per prompt (with --height/--width; default 1)")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="above 1, classifier-free guidance doubles the denoiser's batch where the pipeline "
                             "batches negatives (default: the pipeline's own)")
    parser.add_argument("--num-frames", type=int, default=None, help="video pipelines: frames per video")
    parser.add_argument("--max-sequence-length", type=int, default=None,
                        help="text tokens per prompt (diffusers pipelines; default: the pipeline's own)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the plan as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    call = call_spec(args)
    plan = plan_target(args.target, device_map=args.strategy, max_memory=args.max_memory, torch_dtype=args.dtype,
                       offload_folder=args.offload_folder, call=call)
    if call is not None:  # what the activation peaks below are for
        print("Planned for the call: " + ", ".join(f"{key}={value}" for key, value in call.items()) + "\n")
    print(plan.explain())
    if args.json is not None:
        write_json(args.json, plan.to_json())
        print(f"\nPlan written to {args.json}")
    return 0


def plan_target(target: str, *, device_map, max_memory, torch_dtype, offload_folder, call) -> Plan:
    from ..framework.planning import plan_pipeline
    from ..text_to_image.pipeline import TextToImagePipeline
    from ..text_to_image.presets import PRESETS

    if target in PRESETS:
        pipe = TextToImagePipeline.from_preset(target, device="meta")
        return plan_pipeline(pipe, device_map=device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                             offload_folder=offload_folder, call=call, pinned={})
    folder = _folder(target)
    return pipeline_class_of(folder).plan_placement(folder, device_map=device_map, max_memory=max_memory,
                                                    torch_dtype=torch_dtype, offload_folder=offload_folder,
                                                    call=call)


def pipeline_class_of(folder: Path) -> type:
    """The folder's own pipeline class when it is one of ours (so call= works), else the generic Pipeline."""
    import pipelines

    from ..framework.model_index import ModelIndex
    from ..framework.pipeline import Pipeline

    found = getattr(pipelines, ModelIndex.read(folder).class_name, None)
    return found if isinstance(found, type) and issubclass(found, Pipeline) else Pipeline


def _folder(target: str) -> Path:
    from ..framework.sources import resolve_pipeline_folder
    from ..text_to_image.presets import PRESETS

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


class PlanTargetError(PlacementError, ValueError):
    """A `placement plan` target that is neither a preset, a folder nor a reachable Hub id."""
