"""`placement demo`: the whole workflow on a tiny pipeline, in well under a minute on a laptop CPU.

Writes the "tiny-flux" preset (diffusers' FluxPipeline at tiny configs, random weights seeded with 0) into the
user's cache once, loads it with device_map="balanced" over the accelerators present (the CPU when there are
none), generates one image,
prints the plan and hf_device_map, writes demo.png in the current folder, then prints the plan the same
pipeline would get on the --simulate budgets (default: two 24 GiB GPUs) and draws it in plan.svg beside
demo.png. The preset's weights are random (seeded), so the image is noise: the demo shows the workflow, not
a trained model.
"""

from __future__ import annotations

import argparse
import io
import time
import warnings
from pathlib import Path

from .args import budgets_arg, image_output_arg, positive_int_arg, write_file, write_text

PROMPT = "a lighthouse on a cliff at sunset"
PRESET = "tiny-flux"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="save, plan, load and run a tiny pipeline; write demo.png",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--simulate", type=budgets_arg, default=budgets_arg("2x24GiB"), metavar="BUDGETS",
                        help="budgets to show a plan for, as --max-memory takes them: 2x24GiB (default) or "
                             "0=24GiB,1=12GiB")
    parser.add_argument("--size", type=positive_int_arg("--size", "128"), default=128,
                        help="image height and width in pixels (default 128)")
    parser.add_argument("--steps", type=positive_int_arg("--steps", "8"), default=8, help="denoising steps (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=image_output_arg, default=Path("demo.png"),
                        help="where to write the image: .png (default demo.png), .jpg, .webp, ... (plan.svg goes "
                             "beside it)")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from placement.sizes import parse_size

    from ..hf.quiet import quiet
    from ..framework.pipeline import Pipeline
    from ..presets.catalog import preset_folder
    from .targets import in_flag_names, resolve_budgets_arg

    simulate = resolve_budgets_arg(args.simulate, "--simulate")
    started = time.perf_counter()
    with quiet():
        folder = preset_folder(PRESET)
    print(f"The {PRESET} preset (seed 0) is in {folder}; loading it with device_map='balanced'.\n")
    with warnings.catch_warnings(), quiet():
        warnings.simplefilter("ignore")  # the plan lists its warnings (e.g. no accelerator: CPU) below
        pipe = Pipeline.from_pretrained(folder, device_map="balanced", progress=False)
    print(in_flag_names(pipe.placement_plan.explain()))
    print(f"\npipe.hf_device_map = {pipe.hf_device_map}\n")

    generator = torch.Generator().manual_seed(args.seed)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,
                 generator=generator, output_type="pil").images[0]
    write_file(args.output, encoded(image, args.output))
    print(f"Generated {args.size}x{args.size} in {args.steps} steps for {PROMPT!r}: wrote {args.output}. "
          "The preset's weights are random, so the image is noise: it shows the pipeline ran, not a picture.")

    budgets = ", ".join(f"{'GPU ' if isinstance(device, int) else ''}{device}: {parse_size(size) / 2**30:.0f} GiB"
                        for device, size in simulate.items())
    print(f"\nThe same pipeline planned for {budgets} and this {args.size}x{args.size} call "
          "(planning only, nothing loaded):\n")
    with warnings.catch_warnings(), quiet():
        warnings.simplefilter("ignore")  # listed in the plan below
        simulated = Pipeline.plan_placement(folder, max_memory=simulate, call={"height": args.size, "width": args.size})
    print(in_flag_names(simulated.explain()).replace("given (--max-memory)", "given (--simulate)"))
    picture = args.output.with_name("plan.svg")
    write_text(picture, simulated.to_svg())
    print(f"\nThat plan's picture: {picture} (open it in a browser).")
    print(f"Done in {time.perf_counter() - started:.1f} s. Next: placement plan flux "
          "--max-memory 2x24GiB --dtype bf16 --height 1024 --width 1024 --svg flux.svg")
    return 0


def encoded(image, path: Path) -> bytes:
    """`image` in the format `path`'s extension names (PIL's own choice), as bytes written whole by `write_file`."""
    from PIL import Image

    buffer = io.BytesIO()
    image.save(buffer, format=Image.registered_extensions()[path.suffix.lower()])
    return buffer.getvalue()
