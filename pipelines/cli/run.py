"""`placement run TARGET --prompts FILE --out DIR`: one image per prompt line, over as many replicas as launched.

Run plainly, one process plans the pipeline over the whole machine (the verdict is printed first), loads it and
generates every image. Under `torchrun --nproc_per_node N [--nnodes M ...] -m pipelines.cli run ...` each
process is one replica on its own GPU group (planned per node by `placement.plan_replicas`, honouring
--max-memory and --group-size; PLACEMENT_VIRTUAL_ACCELERATORS=N gives a CPU machine N accelerators to try it
on; with no accelerator at all each process runs on the CPU) and generates every (N*M)-th prompt.

Each image is written as soon as it is made: DIR/00000.png, ... and DIR/run.json (per image its prompt, seed,
rank, GPUs, seconds), each file whole or not at all. A rerun skips the images already made (--overwrite makes
them again); Ctrl-C stops after the current image. One bar counts the steps of every image, with an ETA.
Prompt i uses seed SEED + i, so its image does not depend on which replica made it. Height, width, steps and
guidance default to the pipeline's own. TARGET is a pipeline folder, a Hub id or a preset with weights (tiny-flux,
tiny-sd15; random weights from seed 0, the same on every rank: its images are noise). The real presets
(flux, sdxl, ...) have configs only: plan them, and run the real model's folder or Hub id.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .args import (add_guidance_parallel_argument, budgets_arg, configs_only_preset, dtype_arg, finite_float_arg,
                   path_problem, positive_int_arg, refused, strategy_arg, target_problem)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="generate one image per prompt; under torchrun, one pipeline replica per process",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a pipeline folder, a Hub id, or a preset (tiny-flux, tiny-sd15)")
    parser.add_argument("--prompts", type=Path, required=True, metavar="FILE", help="one prompt per line")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where images and run.json go")
    parser.add_argument("--height", type=positive_int_arg("--height", "1024"), default=None,
                        help="image height (default: the pipeline's own)")
    parser.add_argument("--width", type=positive_int_arg("--width", "1024"), default=None,
                        help="image width (default: the pipeline's own)")
    parser.add_argument("--steps", type=positive_int_arg("--steps", "28"), default=None,
                        help="denoising steps (default: the pipeline's own)")
    parser.add_argument("--guidance-scale", type=finite_float_arg("--guidance-scale"), default=None,
                        help="classifier-free guidance scale (default: the pipeline's own)")
    parser.add_argument("--negative-prompt", default=None, help="what the images should not show (every prompt)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed SEED + i (default 0)")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: as saved)")
    parser.add_argument("--strategy", type=strategy_arg, default="balanced",
                        help="balanced (default), sequential, balanced_low_0, auto; plainly run also a device or "
                             "a JSON dict")
    parser.add_argument("--max-memory", type=budgets_arg, default=None, metavar="BUDGETS",
                        help="one node's budgets, e.g. 0=80GiB,1=80GiB,cpu=512GiB (default: detected)")
    parser.add_argument("--group-size", type=positive_int_arg("--group-size", "2"), default=None,
                        help="GPUs per replica under torchrun (default: the size that gives the most replicas)")
    add_guidance_parallel_argument(parser)
    parser.add_argument("--overwrite", action="store_true", help="make every image again, even those in DIR")
    parser.add_argument("--wait", action="store_true",
                        help="another run writing into DIR: wait for it to finish, then go on (default: refuse)")
    parser.add_argument("--timeout", type=finite_float_arg("--timeout"), default=1800.0,
                        help="seconds a rank waits for the others before giving up (default 1800)")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    early = refused(args, target_problem(args.target) or configs_only_preset(args.target)
                    or path_problem(args.out, flag="--out", folder=True))
    if early is not None:  # said before torch loads (seconds)
        return early

    from ..distributed.images import read_prompts, run_lock
    from ..distributed.replica import Launch, check_gpu_budgets_have_gpus, folder_pipeline_class
    from ..errors import ImageRunError, ReplicaLoadError
    from ..hf.quiet import quiet
    from . import EXIT_BAD_INPUT
    from .run_job import RunJob
    from .targets import check_callable, default_call, hf_libraries, resolve_budgets_arg, warnings_once

    launch = Launch.from_env()
    if args.group_size is not None and not launch.distributed:
        args.parser.error("--group-size sets the GPUs of each replica under torchrun; a plain run places one "
                          "pipeline over every GPU (use --max-memory to choose them).")
    prompts = read_prompts(args.prompts)
    with warnings_once():
        max_memory = resolve_budgets_arg(args.max_memory, "--max-memory")
    if not launch.distributed:  # under torchrun, local rank 0 says it once for every rank (load_replica)
        check_gpu_budgets_have_gpus(max_memory)
    start = time.perf_counter()
    given = {"height": args.height, "width": args.width, "num_inference_steps": args.steps,
             "guidance_scale": args.guidance_scale, "negative_prompt": args.negative_prompt}
    given = {key: value for key, value in given.items() if value is not None}
    # Rank 0 writes OUT: it holds OUT's lock from before anything is read or planned until its last write.
    locked = run_lock(args.out, wait=args.wait) if launch.rank == 0 else nullcontext()
    with locked, _pipeline_folder(args.target) as (source, configs, label):
        with quiet(preload=hf_libraries(configs)):  # reading the class may import diffusers: quietly
            cls = folder_pipeline_class(configs)
            check_callable(configs, cls)
            call = {**default_call(configs, cls), **given}  # what the images are made with: plan and run.json
        job = RunJob(args=args, launch=launch, prompts=prompts, source=source, label=label, configs=configs,
                     cls=cls, given=given, call=call, max_memory=max_memory)
        try:
            result = job.run()
        except (ReplicaLoadError, ImageRunError):
            if launch.rank == 0:
                raise
            return EXIT_BAD_INPUT  # every rank has the same error: rank 0 prints it, once
    if result is None or (result.made == 0 and result.skipped == len(prompts)):
        return 0  # not rank 0 (it reports through rank 0), or nothing was left to make (said so already)
    seconds = time.perf_counter() - start
    already = f", {result.skipped} already there" if result.skipped else ""
    print(f"{result.made} image(s) made by {launch.world_size} replica(s) in {seconds:.1f} s{already}: {args.out}; "
          f"see {args.out / 'run.json'}")
    return 0


@contextmanager
def _pipeline_folder(target: str):
    """(what to load, a local folder with its configs, the name run.json gives it): TARGET itself (a Hub id: its
    configs downloaded; a folder: by its absolute path), or a preset's folder (written once into the user's
    cache: every rank reads the same files)."""
    from .targets import is_folder_preset, target_folder

    if is_folder_preset(target):
        folder = target_folder(target)
        yield str(folder), folder, f"preset {target} (seed 0)"
        return
    configs = target_folder(target)
    yield target, configs, str(Path(target).resolve()) if Path(target).exists() else target
