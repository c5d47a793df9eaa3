"""`placement run TARGET --prompts FILE --out DIR`: one image per prompt line, over as many replicas as launched.

Run plainly, one process places the pipeline over the whole machine and generates every image. Under
`torchrun --nproc_per_node N [--nnodes M ...] -m pipelines.cli run ...` each process is one replica on its own
GPU group (planned per node by `placement.plan_replicas`; without GPUs each process runs on the CPU) and
generates every (N*M)-th prompt; rank 0 writes DIR/00000.png ... and DIR/run.json. Prompt i uses seed
SEED + i, so its image does not depend on which replica made it. TARGET is a pipeline folder, a Hub id or a
preset (built with random weights from seed 0 on every rank: its images are noise).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from .args import budgets_arg, dtype_arg, torch_dtype


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="generate one image per prompt; under torchrun, one pipeline replica per process",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a pipeline folder, a Hub id, or a preset (tiny-unet, tiny-dit, ...)")
    parser.add_argument("--prompts", type=Path, required=True, metavar="FILE", help="one prompt per line")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where images and run.json go")
    parser.add_argument("--height", type=int, default=512, help="image height (default 512)")
    parser.add_argument("--width", type=int, default=512, help="image width (default 512)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed SEED + i (default 0)")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: as saved)")
    parser.add_argument("--max-memory", type=budgets_arg, default=None, metavar="BUDGETS",
                        help="one node's budgets, e.g. 0=80GiB,1=80GiB,cpu=512GiB (default: detected)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="GPUs per replica under torchrun (default: the size that gives the most replicas)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a rank waits for the others before giving up (default 1800)")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    from ..distributed import load_replica
    from ..distributed.images import generate_share, read_prompts, write_run
    from ..distributed.planning import folder_pipeline_class
    from .resolve import resolve_budgets_arg

    prompts = read_prompts(args.prompts)
    call = {"height": args.height, "width": args.width, "num_inference_steps": args.steps}
    start = time.perf_counter()
    with _pipeline_folder(args.target) as folder:
        cls = folder_pipeline_class(folder)
        plan_call = {"height": args.height, "width": args.width} if hasattr(cls, "activation_inputs") else None
        replica = load_replica(folder, prompts, pipeline_class=cls, torch_dtype=torch_dtype(args.dtype),
                               max_memory=resolve_budgets_arg(args.max_memory, "--max-memory"), call=plan_call, group_size=args.group_size,
                               timeout=timedelta(seconds=args.timeout))
        with replica:
            gathered = replica.gather(generate_share(replica, call, args.seed))
            if gathered is None:
                return 0  # not rank 0: it wrote nothing, and reports through rank 0
            path = write_run(args.out, gathered, source=args.target, call=call, seed=args.seed,
                             world_size=replica.launch.world_size, seconds=time.perf_counter() - start)
    print(f"{len(gathered)} image(s) by {replica.launch.world_size} replica(s) in {args.out}; see {path}")
    return 0


@contextmanager
def _pipeline_folder(target: str):
    """The folder to load: TARGET itself, or a preset saved into a temporary folder (each rank its own)."""
    from ..text_to_image.pipeline import TextToImagePipeline
    from ..text_to_image.presets import PRESETS

    if target not in PRESETS or Path(target).exists():
        yield target
        return
    with tempfile.TemporaryDirectory(prefix=f"placement-run-{target}-") as folder:
        TextToImagePipeline.from_preset(target, seed=0).save_pretrained(folder)
        yield folder
