"""Argument parsing of the `placement` subcommands, forgiving the habits of neighbouring tools.

Imports nothing beyond the standard library, so `placement --help` and argument errors answer at once: types
check the syntax, `placement` parses the values when the command runs. `--max_memory` is read as `--max-memory`
(accelerate's and diffusers' scripts use underscores); an unknown flag or command names the closest known one;
an error is one line and a pointer to `--help`; a value starting with "-" is a value (`--max-memory -1=24GiB`
reaches the budget parser, which says why a device id is never negative)."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Sequence


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
BUDGET_EXAMPLE = "0=24GiB,1=24GiB,cpu=64GiB or 2x24GiB,cpu=64GiB"
_REPEAT = re.compile(r"^(\d+)\s*x\s*(\S.*)$", re.IGNORECASE)
_NEGATIVE = re.compile(r"-\s*\d+")


@dataclass(frozen=True, kw_only=True)
class BudgetsArg:
    """A budget string as typed: (device, size) spellings, `NxSIZE` expanded to N accelerators after those named."""

    text: str
    items: tuple[tuple[str, str], ...]


def budgets_arg(text: str) -> BudgetsArg:
    """"0=24GiB,1=24GiB,cpu=64GiB", "2x24GiB" or both: one syntax for every flag."""
    items: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, separator, size = item.partition("=")
        repeat = _REPEAT.match(item)
        if separator and device.strip() and size.strip():
            items.append((device.strip(), size.strip()))
        elif repeat and not separator:
            taken = [int(d) for d, _ in items if d.isdigit()]
            first = max(taken, default=-1) + 1
            items += [(str(first + i), repeat.group(2).strip()) for i in range(int(repeat.group(1)))]
        else:
            raise argparse.ArgumentTypeError(_not_a_budget(item))
    negative = [device for device, _ in items if _NEGATIVE.fullmatch(device)]
    if negative:
        raise argparse.ArgumentTypeError(
            f"{text!r}: device {negative[0]!r} is negative; GPUs are numbered from 0 (0=24GiB,1=24GiB), the host is "
            "cpu=, the disk disk=.")
    if not items:
        raise argparse.ArgumentTypeError(f"no budget given; write e.g. {BUDGET_EXAMPLE}.")
    return BudgetsArg(text=text, items=tuple(items))


def _not_a_budget(item: str) -> str:
    """Why `item` is no budget item; a ':' typed for '=' (`0:24GiB`) gets its own words."""
    device, colon, size = item.rpartition(":")
    if colon and device.strip() and size.strip() and not size.strip().isdigit():
        return f"{item!r} separates device and size with ':'; write {device.strip()}={size.strip()} (DEVICE=SIZE)."
    return f"{item!r} is not DEVICE=SIZE nor NxSIZE; write e.g. {BUDGET_EXAMPLE}."


def positive_int_arg(flag: str, example: str):
    """An argument type: a whole number of 1 or more, refused in the flag's words."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; write e.g. {flag} {example}.") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is not 1 or more; write e.g. {flag} {example}.")
        return value
    parse.__name__ = "positive whole number"  # argparse names the type in some messages
    return parse


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. --strength 0.6.") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not above 0 and at most 1 (the share of the steps that run); "
                                         "write e.g. --strength 0.6.")
    return value


def finite_float_arg(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; write e.g. {flag} 3.5.")
        return value
    parse.__name__ = "number"
    return parse


def dtype_arg(text: str) -> str:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}.") from None


STORAGE_DTYPES = {"fp8_e4m3fn": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn",
                  "fp8_e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2"}


def layerwise_casting_arg(text: str) -> dict[str, str]:
    """`transformer=fp8_e4m3fn[,vae=fp8_e5m2]` -> {component: storage dtype name}."""
    parsed = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, dtype = item.partition("=")
        if not name.strip() or dtype.strip().lower() not in STORAGE_DTYPES:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not COMPONENT=DTYPE with DTYPE one of {', '.join(STORAGE_DTYPES)}; write e.g. "
                "transformer=fp8_e4m3fn.")
        parsed[name.strip()] = STORAGE_DTYPES[dtype.strip().lower()]
    return parsed


def torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


# placement's strategies and device spellings (a test holds them equal), so a typo is refused before torch loads.
STRATEGY_NAMES = ("balanced", "auto", "sequential", "balanced_low_0")
DEVICE_SPELLING = re.compile(r"(cpu|disk|\d+|(cuda|xpu|mps|npu|vgpu)(:\d+)?)")


def strategy_arg(text: str):
    """A strategy name, a single device, or a JSON dict {component: device}."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {error}") from error
    if stripped.lower() not in STRATEGY_NAMES and not DEVICE_SPELLING.fullmatch(stripped.lower()):
        close = difflib.get_close_matches(stripped.lower(), STRATEGY_NAMES, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(
            f"unknown strategy {text!r}{guess}: use {', '.join(STRATEGY_NAMES)}, a device (0, cuda:1, cpu) or a "
            "JSON dict {component: device}")
    return int(stripped) if stripped.isdigit() else stripped


# The presets' names (a test holds them equal to pipelines.presets.catalog.FOLDER_PRESETS, diffusers' classes), so
# that a TARGET naming nothing is told before torch loads.
PRESET_NAMES = ("tiny-flux", "tiny-sd15", "flux", "sd15", "sdxl", "sd3-medium", "sd35-large", "wan2.1-t2v-14b")
# The presets of the library's own models, retired with them (one model world: diffusers' and transformers'
# classes), each with the preset that replaces it.
RETIRED_PRESETS = {"tiny-dit": "tiny-flux", "tiny-unet": "tiny-sd15", "flux-like": "flux", "sdxl-like": "sdxl"}


def target_problem(target: str) -> str | None:
    """Why TARGET names nothing, found without torch: a preset one edit off, or a local path that does not exist.
    None for a preset, an existing path, or a Hub id (which only the Hub can answer)."""
    from ..folder.paths import looks_like_a_path  # standard library only

    path = Path(target).expanduser()
    if path.exists() or target in PRESET_NAMES:
        return None
    if target in RETIRED_PRESETS:
        return (f"The {target} preset (this library's own models) is retired: use {RETIRED_PRESETS[target]}, the same "
                "layout built from diffusers' and transformers' classes.")
    typo = preset_typo(target)
    if typo is not None:  # said before the Hub is asked: a Hub id is owner/name, never one edit from a preset
        return (f"{target!r} is not a preset; did you mean {typo!r}? (the presets: {', '.join(PRESET_NAMES)}; "
                "otherwise give a folder or a Hub id owner/name)")
    if looks_like_a_path(target):
        return (f"No such folder: {target!r} (looked for {str(path.resolve())!r}). Check the path; a Hub id is "
                "written owner/name.")
    return None


# The presets of real pipelines: their published configs, no weights (pipelines.presets.catalog.REAL_PRESETS, held
# equal by a test), with the Hub id whose weights run them.
CONFIGS_ONLY_PRESETS = {"flux": "black-forest-labs/FLUX.1-dev", "sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5",
                        "sdxl": "stabilityai/stable-diffusion-xl-base-1.0",
                        "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers",
                        "sd35-large": "stabilityai/stable-diffusion-3.5-large",
                        "wan2.1-t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers"}


def configs_only_preset(target: str) -> str | None:
    """Why a real preset cannot run (it has configs, no weights), with what to run instead; None otherwise."""
    if target not in CONFIGS_ONLY_PRESETS or Path(target).exists():
        return None
    return (f"The {target} preset has the published configs only, no weights: it is for `placement plan {target}` and "
            f"`placement inspect {target}`. To make images, run the real model ({CONFIGS_ONLY_PRESETS[target]}, or its "
            "folder), or the runnable tiny-flux preset.")


def preset_typo(target: str) -> str | None:
    """The preset `target` is one edit from (a letter added, dropped or changed, '_' for '-', case), or None."""
    spelled = target.lower().replace("_", "-")
    return next((name for name in PRESET_NAMES if name != target and _one_edit(spelled, name)), None)


def _one_edit(a: str, b: str) -> bool:
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def refused(args: argparse.Namespace, problem: str | None) -> int | None:
    """A bad input found before torch loads (`problem`, None when there is none): printed as `main` prints an
    error, one line, and the exit code of bad input; None lets the command go on."""
    from . import EXIT_BAD_INPUT

    if problem is None:
        return None
    print(f"{args.parser.prog}: error: {problem}", file=sys.stderr)
    return EXIT_BAD_INPUT


def image_output_arg(text: str) -> Path:
    """A path whose extension names an image format PIL writes."""
    from PIL import Image  # PIL imports no torch: argument errors stay immediate

    path = Path(text)
    writable = sorted(ext for ext, image_format in Image.registered_extensions().items() if image_format in Image.SAVE)
    if path.suffix.lower() not in writable:
        common = [ext for ext in (".png", ".jpg", ".webp", ".bmp", ".tiff") if ext in writable]
        what = f"extension {path.suffix!r} is not an image format" if path.suffix else "it has no extension"
        raise argparse.ArgumentTypeError(f"{text!r}: {what}; name an image file, e.g. demo{common[0]} "
                                         f"({', '.join(common)} or another format PIL writes).")
    return path


def output_arg(text: str) -> Path | str:
    return "-" if text == "-" else Path(text)


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    whole = positive_int_arg
    parser.add_argument("--height", type=whole("--height", "1024"), default=None,
                        help="plan for a call at this image height (default: the pipeline's own)")
    parser.add_argument("--width", type=whole("--width", "1024"), default=None,
                        help="plan for a call at this image width (default: the pipeline's own)")
    parser.add_argument("--batch-size", type=whole("--batch-size", "2"), default=None, help="prompts per call")
    parser.add_argument("--num-images-per-prompt", type=whole("--num-images-per-prompt", "2"), default=None,
                        help="images per prompt (default 1)")
    parser.add_argument("--guidance-scale", type=finite_float_arg("--guidance-scale"), default=None,
                        help="above 1, classifier-free guidance doubles the denoiser's batch where the pipeline "
                             "batches negatives (default: the pipeline's own)")
    parser.add_argument("--num-frames", type=whole("--num-frames", "49"), default=None,
                        help="video pipelines: frames per video")
    parser.add_argument("--max-sequence-length", type=whole("--max-sequence-length", "512"), default=None,
                        help="text tokens per prompt (diffusers pipelines; default: the pipeline's own)")
    parser.add_argument("--steps", type=whole("--steps", "28"), default=None,
                        help="denoising steps per call (num_inference_steps): how often the denoiser runs, which "
                             "weighs what streaming it costs (default: the pipeline's own)")
    parser.add_argument("--strength", type=fraction_arg, default=None,
                        help="pipelines that start from an image (img2img, inpaint): the share of the steps that "
                             "run, rounded as the pipeline rounds it (default: the pipeline's own)")


GUIDANCE_PARALLEL = {"auto": None, "on": True, "off": False}


def add_guidance_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """--guidance-parallel {auto,on,off}: `guidance_parallel=` None / True / False."""
    parser.add_argument("--guidance-parallel", choices=sorted(GUIDANCE_PARALLEL), default="auto",
                        help="run classifier-free guidance's two branches on two GPUs that each hold the denoiser: "
                             "auto (default: where predicted faster), on (wherever it applies; the plan says why "
                             "not elsewhere), off")


def guidance_parallel_arg(args: argparse.Namespace):
    return GUIDANCE_PARALLEL[getattr(args, "guidance_parallel", "auto")]


def call_spec(args: argparse.Namespace) -> dict | None:
    """`call=` from the call flags given (None when none is); a size left out is the pipeline's own, filled later."""
    keys = ("height", "width", "batch_size", "num_images_per_prompt", "guidance_scale", "num_frames",
            "max_sequence_length", "num_inference_steps", "strength")
    given = {key: getattr(args, "steps" if key == "num_inference_steps" else key) for key in keys}
    return {key: value for key, value in given.items() if value is not None} or None


_EXAMPLE_FILES = {"--svg": "plan.svg", "--timeline": "timeline.json"}  # a file each flag writes, for its example


def path_problem(path: Path | str | None, *, flag: str, folder: bool) -> str | None:
    """Why `flag`'s `path` cannot be written as a file or used as a folder (made if absent), or None: checked before
    any work, so a typo does not cost a plan first."""
    if path is None or path == "-":
        return None
    path = Path(path)
    if path.exists():
        if folder and not path.is_dir():
            return f"{flag} {str(path)!r} is a file, not a folder; name a folder (it is made if it does not exist)."
        if not folder and path.is_dir():
            example = path / _EXAMPLE_FILES.get(flag, "plan.json")
            return f"{flag} {str(path)!r} is a folder; name a file in it, e.g. {str(example)!r}."
        if not os.access(path, os.W_OK):
            return f"{flag} {str(path)!r}: cannot write there (permission denied)."
        return None
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        return f"{flag} {str(path)!r}: cannot access it, {str(parent)!r} is a file, not a folder."
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {str(path)!r}: cannot create it in {str(parent)!r} (permission denied)."
    return None


def write_text(path: Path | str, text: str) -> None:
    """`text` into the file `path` (see `write_file`), or onto stdout for "-"."""
    text = text if text.endswith("\n") else text + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    write_file(Path(path), text.encode("utf-8"))


def write_file(path: Path, data: bytes) -> None:
    """`data` into the file `path` (through a link the user made there: into the file it names), whole or not at
    all: a full disk leaves the previous file as it was and names the path."""
    from ..checkpoint.saving import write_file_atomically
    from ..errors import CheckpointSaveError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path.resolve() if path.is_symlink() else path, data)
    except OSError as error:
        raise CheckpointSaveError(
            f"Cannot write {str(path)!r}: {error.strerror or error}"
            f"{f' (errno {error.errno})' if error.errno else ''}. The file there (if any) is unchanged; free disk "
            "space or fix the permissions, or choose another path."
        ) from error


_INVALID_CHOICE = re.compile(
    r"argument (?P<argument>\S+): invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)")


class ForgivingArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through `add_subparsers`, every subcommand's) with the habits above."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._values_attached(self._hyphenated(args)), namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._command_parser(parsed).error(self._unrecognized(parsed, unknown))
        return parsed

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.search(message)
        if choice is not None:
            known = [name.strip(" '") for name in choice["choices"].split(",")]
            what = "command" if choice["argument"] == "COMMAND" else f"value for {choice['argument']}"
            message = f"unknown {what} {choice['given']!r}{suggestion(choice['given'], known)}; " \
                      f"the choices are {', '.join(known)}"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _values_attached(self, args: list[str]) -> list[str]:
        """`--flag -value` as `--flag=-value` where `--flag` takes one value and `-value` is no flag of this parser."""
        takes_one = {option for action in self._actions if action.nargs is None for option in action.option_strings}
        known = set(self._option_strings())
        fixed: list[str] = []
        position = 0
        while position < len(args):
            arg, following = args[position], args[position + 1] if position + 1 < len(args) else ""
            if arg == "--":
                return fixed + args[position:]
            if arg in takes_one and following.startswith("-") and not following.startswith("--") \
                    and following != "-" and following.partition("=")[0] not in known:
                fixed.append(f"{arg}={following}")
                position += 2
                continue
            fixed.append(arg)
            position += 1
        return fixed

    def _hyphenated(self, args: list[str]) -> list[str]:
        """`--a_b[=value]` as `--a-b[=value]` where this parser knows `--a-b` (or a flag it abbreviates)."""
        known = self._option_strings()
        fixed: list[str] = []
        for position, arg in enumerate(args):
            if arg == "--":
                return fixed + args[position:]
            name, separator, value = arg.partition("=")
            if name.startswith("--") and "_" in name:
                spelled = "--" + name[2:].replace("_", "-")
                if any(option.startswith(spelled) for option in known):
                    arg = spelled + separator + value
            fixed.append(arg)
        return fixed

    def _option_strings(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings]

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser when one was chosen (its usage line is the one to show), else this one."""
        return getattr(parsed, "parser", None) or self

    def _unrecognized(self, parsed: argparse.Namespace, unknown: list[str]) -> str:
        known = self._command_parser(parsed)._option_strings()
        described = []
        for arg in unknown:
            name = arg.partition("=")[0]
            hint = suggestion(name, known) if name.startswith("-") else ""
            described.append(f"{arg}{hint}")
        noun = "argument" if len(unknown) == 1 else "arguments"
        return f"unrecognized {noun}: " + ", ".join(described)


def suggestion(given: str, known: Sequence[str]) -> str:
    """" (did you mean --max-memory?)" for the closest of `known`, or ""."""
    close = difflib.get_close_matches(given.replace("_", "-"), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
