"""`placement demo`: the whole workflow on a tiny pipeline, in well under a minute on a laptop CPU.

Builds the "tiny-dit" preset with a fixed seed, saves it to a temporary folder, loads it back with
device_map="balanced" over the accelerators present (the CPU when there are none), generates one image,
prints the plan and hf_device_map, writes demo.png in the current folder, then prints the plan the same
pipeline would get on the --simulate budgets (default: two 24 GiB GPUs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch

from .args import simulate_arg

PROMPT = "a lighthouse on a cliff at sunset"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="save, plan, load and run a tiny pipeline; write demo.png",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--simulate", type=simulate_arg, default=simulate_arg("2x24GiB"), metavar="BUDGETS",
                        help="budgets to show a plan for, e.g. 2x24GiB (default), 24GiB,12GiB or 0=24GiB,1=12GiB")
    parser.add_argument("--size", type=int, default=128, help="image height and width in pixels (default 128)")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("demo.png"), help="where to write the image")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..text_to_image.pipeline import TextToImagePipeline

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="placement-demo-") as scratch:
        folder = Path(scratch) / "tiny-dit"
        TextToImagePipeline.from_preset("tiny-dit", seed=args.seed).save_pretrained(folder)
        print(f"Saved the tiny-dit preset (seed {args.seed}) to a temporary folder; loading it with "
              "device_map='balanced'.\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan lists its warnings (e.g. no accelerator: CPU) below
            pipe = TextToImagePipeline.from_pretrained(folder, device_map="balanced", progress=False)
        print(pipe.placement_plan.explain())
        print(f"\npipe.hf_device_map = {pipe.hf_device_map}\n")

        generator = torch.Generator().manual_seed(args.seed)
        image = pipe(PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,
                     generator=generator, output_type="pil").images[0]
        image.save(args.output)
        print(f"Generated {args.size}x{args.size} in {args.steps} steps for {PROMPT!r}: wrote {args.output}")

        budgets = ", ".join(f"{'GPU ' if isinstance(device, int) else ''}{device}: {size / 2**30:.0f} GiB"
                            for device, size in args.simulate.items())
        print(f"\nThe same pipeline planned for {budgets} and this {args.size}x{args.size} call "
              "(planning only, nothing loaded):\n")
        simulated = TextToImagePipeline.plan_placement(folder, max_memory=args.simulate,
                                                       call={"height": args.size, "width": args.size})
        print(simulated.explain())
    print(f"\nDone in {time.perf_counter() - started:.1f} s. Next: placement plan flux-like "
          "--max-memory 0=24GiB,1=24GiB --dtype bf16 --height 1024 --width 1024")
    return 0
