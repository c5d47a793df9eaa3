"""Argument parsing shared by the CLI subcommands: budgets, dtypes, call specs, plan targets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from placement.devices import normalize_device
from placement.errors import PlacementError
from placement.sizes import parse_size

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def max_memory_arg(text: str) -> dict:
    """"0=24GiB,1=24GiB,cpu=64GiB" -> {0: bytes, 1: bytes, "cpu": bytes} (devices and sizes validated)."""
    budgets = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, separator, size = item.partition("=")
        if not separator:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not DEVICE=SIZE; write e.g. --max-memory 0=24GiB,1=24GiB,cpu=64GiB."
            )
        try:
            budgets[normalize_device(device.strip())] = parse_size(size.strip())
        except PlacementError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
    if not budgets:
        raise argparse.ArgumentTypeError("--max-memory is empty; write e.g. 0=24GiB,1=24GiB.")
    return budgets


def simulate_arg(text: str) -> dict:
    """"2x24GiB" (N GPUs of one size), "24GiB,12GiB" (one per GPU) or the --max-memory form."""
    if "=" in text:
        return max_memory_arg(text)
    count, separator, size = text.partition("x")
    try:
        if separator and count.strip().isdigit():
            return {index: parse_size(size.strip()) for index in range(int(count))}
        return {index: parse_size(part.strip()) for index, part in enumerate(text.split(","))}
    except PlacementError as error:
        raise argparse.ArgumentTypeError(f"{error} Write e.g. --simulate 2x24GiB or 24GiB,12GiB.") from error


def dtype_arg(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"Unknown dtype {text!r}; use one of {', '.join(DTYPES)}.") from None


def strategy_arg(text: str):
    """A strategy name, a single device, or a JSON dict {component: device}."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"--strategy {text!r} is not valid JSON: {error}") from error
    return int(stripped) if stripped.isdigit() else stripped


def call_spec(args: argparse.Namespace) -> dict | None:
    """`call=` for planning from --height/--width/--batch-size/--num-images-per-prompt/--guidance-scale/
    --num-frames/--max-sequence-length (None when none is given)."""
    given = {"height": args.height, "width": args.width, "batch_size": args.batch_size,
             "num_images_per_prompt": args.num_images_per_prompt, "guidance_scale": args.guidance_scale,
             "num_frames": getattr(args, "num_frames", None),
             "max_sequence_length": getattr(args, "max_sequence_length", None)}
    if all(value is None for value in given.values()):
        return None
    if args.height is None or args.width is None:
        raise SystemExit("placement plan: give both --height and --width to plan for a call.")
    return {key: value for key, value in given.items() if value is not None}


def write_json(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
