"""`placement calibrate`: measure this machine once and save its profile, which later plans use and name.

Per GPU (CUDA; with PLACEMENT_VIRTUAL_ACCELERATORS=N the virtual ones, which are the CPU): pinned and pageable
host -> GPU copies, device memory speed, matmul / attention (SDPA) / conv throughput at bf16, fp16, fp32 and fp8
where the GPU has it; the CPU's matmul and conv throughput; the checkpoint drive's read speed (a temporary file
in --disk-folder, default the profile's folder); host RAM. Each figure runs about --seconds. What it cannot
measure here is said. The profile is saved in $PLACEMENT_CACHE_DIR, else $XDG_CACHE_HOME/pipeline-placement, else
~/.cache/pipeline-placement (machine-profile.json), replacing the previous measurement; the corrections placed runs
saved there are kept. Plans made on this machine without --gpu use it where its GPU is the one present.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import finite_float_arg, path_problem


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's GPUs, CPU and drive once; later plans use the profile",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--disk-folder", type=Path, default=None, metavar="DIR",
                        help="a folder on the drive your checkpoints are on (default: the profile's folder)")
    parser.add_argument("--seconds", type=finite_float_arg("--seconds"), default=1.0,
                        help="seconds each figure is measured for (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes: a smoke check in seconds, the figures less representative")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    from placement.calibration import Shapes, calibrate
    from placement.errors import PlanError
    from placement.machine_profile import load_profile, profile_path, save_profile

    if not 0 < args.seconds <= 60:
        args.parser.error(f"--seconds {args.seconds:g}: give the seconds per figure, more than 0 and at most 60.")
    path = profile_path()
    for flag, folder in (("--disk-folder", args.disk_folder), ("the profile's folder", path.parent)):
        problem = path_problem(folder, flag=flag, folder=True)
        if problem is not None:
            raise PlanError(problem + ("" if folder is args.disk_folder else
                                       " Set PLACEMENT_CACHE_DIR to a folder you can write."))
    quick = Shapes(matmul=256, attention=(2, 256, 32), conv=(16, 32), copy_bytes=4 * 2**20,
                   disk_bytes=16 * 2**20) if args.quick else None
    print(f"Measuring this machine (about {args.seconds:g} s per figure)...", flush=True)
    profile = calibrate(disk_folder=args.disk_folder, seconds=args.seconds, shapes=quick,
                        say=lambda line: print(f"  {line}", flush=True))
    try:
        previous = load_profile(path)
    except PlanError:  # an unreadable old profile is replaced whole
        previous = None
    if previous is not None and previous.corrections:
        profile = profile.model_copy(update={"corrections": previous.corrections})
    for line in profile.not_measured:
        print(f"  not measured: {line}")
    saved = save_profile(profile, path)
    kept = f" (the {len(profile.corrections)} correction(s) placed runs saved are kept)" if profile.corrections else ""
    print(f"Saved this machine's profile to {saved}{kept}; plans made here without --gpu now use it "
          f"(explain() names it: profile: measured on this machine {profile.measured_on}).")
    return 0
