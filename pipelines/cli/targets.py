"""A command's TARGET (a preset, a local folder, a Hub id), its plan and its default call, and what the CLI prints
in its own words (budgets, library messages in flag names, warnings once). Imported when a command runs (it
imports torch), never for `--help`.

`placement run` passes the pipeline only what the user gave; to plan that call and size its progress bar it
reads the same defaults beforehand: the class's `__call__` defaults (ours, or the diffusers class the folder
names) and, for diffusers' `height=None`, diffusers' own rule (the denoiser's `sample_size` times the VAE's
downsampling). A number not found this way stays unknown, and the plan is made for weights only."""

from __future__ import annotations

import ast
import difflib
import inspect
import re
import sys
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from placement import Plan
from placement.budgets import exact_budgets, warn_zero_budgets
from placement.devices import device_label, normalize_device
from placement.errors import PlacementError
from placement.sizes import parse_budget

from ..distributed.replica import folder_pipeline_class
from ..errors import LoadError
from ..hf.quiet import hf_libraries, quiet
from .args import BUDGET_EXAMPLE, PRESET_NAMES, BudgetsArg, target_problem


STEPS = "num_inference_steps"


def is_folder_preset(target: str) -> bool:
    """A preset built from diffusers classes (flux, tiny-flux, ...): a folder written into the user's cache."""
    from ..presets.catalog import is_folder_preset as named

    return named(target) and not Path(target).exists()


def preset_summary(target: str) -> Optional[str]:
    """For a preset built from diffusers classes, the line that names its classes; None for any other TARGET."""
    from ..presets.catalog import describe

    return describe(target) if is_folder_preset(target) else None


def target_folder(target: str) -> Path:
    """TARGET as a local folder (a preset's: written once; a Hub id: its configs downloaded); not found: what
    TARGET may have meant."""
    from ..folder.sources import resolve_pipeline_folder
    from ..presets.catalog import preset_folder

    problem = target_problem(target)  # the commands ask it first, before torch loads; here for every other caller
    if problem is not None:
        raise LoadError(problem)
    if Path(target).expanduser().exists():
        return resolve_pipeline_folder(Path(target).expanduser(), weights=False)
    if is_folder_preset(target):
        with quiet():
            return preset_folder(target)
    try:
        return resolve_pipeline_folder(target, weights=False)
    except Exception as error:  # the Hub (or the network) said no: say what TARGET may be
        close = difflib.get_close_matches(target, PRESET_NAMES, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        raise LoadError(
            f"{target!r} is not a preset ({', '.join(PRESET_NAMES)}{guess}), nor a local folder, and the Hub did not "
            f"give it: {type(error).__name__}: {error}"
        ) from error


@dataclass(kw_only=True)
class TargetPlanner:
    """`planner(torch_dtype=...)`: the plan of TARGET (a preset's folder, a folder, a Hub id) with these options,
    made quietly."""

    target: str
    device_map: Any
    max_memory: Optional[Mapping]
    offload_folder: Optional[Path]
    call: Optional[Mapping[str, Any]]
    layerwise_casting: Optional[Mapping[str, str]] = None
    gpu: Optional[str] = None
    guidance_parallel: Optional[bool] = None  # --guidance-parallel: None (auto), True (on), False (off)
    notes: list[str] = field(default_factory=list)
    _folder: Optional[Path] = field(default=None, repr=False)  # a Hub id: downloaded once

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = target_folder(self.target)
        return self._folder

    def __call__(self, *, torch_dtype) -> Plan:
        options = dict(device_map=self.device_map, max_memory=self.max_memory, torch_dtype=torch_dtype,
                       offload_folder=self.offload_folder, call=self.call, gpu=self.gpu,
                       guidance_parallel=self.guidance_parallel)
        folder = self.folder()
        if self.layerwise_casting:
            options["layerwise_casting"] = dict(self.layerwise_casting)
        with quiet(preload=hf_libraries(folder)):
            return folder_pipeline_class(folder).plan_placement(folder, **options)


KEYS = ("height", "width", "num_inference_steps", "guidance_scale")
DENOISERS = ("transformer", "unet")


def default_call(folder: Path, pipeline_class: type) -> dict[str, Any]:
    """{height, width, num_inference_steps, guidance_scale} the pipeline in `folder` uses when not told, if found."""
    runtime = _runtime_class(folder, pipeline_class)
    defaults = {} if runtime is None else class_defaults(runtime)
    if "height" not in defaults or "width" not in defaults:
        side = _default_sample_pixels(folder, runtime)
        if side is not None:
            defaults = {"height": side, "width": side, **defaults}
    return {key: defaults[key] for key in KEYS if key in defaults}


def class_defaults(runtime: type) -> dict[str, Any]:
    parameters = inspect.signature(runtime.__call__).parameters
    return {key: parameters[key].default for key in KEYS if key in parameters
            and isinstance(parameters[key].default, (int, float)) and parameters[key].default is not True}


def check_callable(folder: Path, pipeline_class: type) -> None:
    if _runtime_class(folder, pipeline_class) is None:
        raise LoadError(
            f"{str(folder)!r} loads as a generic pipeline (its model_index.json names a class that is neither this "
            "library's nor diffusers'), which cannot be called to make images. Load it in your own script with "
            "its class, or register the class (pipelines.register_class)."
        )


def describes_its_call(folder: Path, pipeline_class: type) -> bool:
    """Whether a plan can account for this pipeline's call: its class has `activation_inputs`, or it is diffusers'."""
    from ..hf.diffusers_pipeline import is_diffusers_folder
    from ..folder.model_index import ModelIndex

    return hasattr(pipeline_class, "activation_inputs") or is_diffusers_folder(ModelIndex.read(folder))


def _runtime_class(folder: Path, pipeline_class: type) -> Optional[type]:
    """The class whose `__call__` runs: ours, or for a generic load of a diffusers folder, the diffusers class."""
    from ..hf.diffusers_pipeline import diffusers_pipeline_class, is_diffusers_folder
    from ..folder.model_index import ModelIndex
    from ..framework.pipeline import Pipeline

    if pipeline_class is not Pipeline:
        return pipeline_class
    index = ModelIndex.read(folder)
    if not is_diffusers_folder(index):
        return None
    return diffusers_pipeline_class(index)


def _default_sample_pixels(folder: Path, runtime: Optional[type]) -> Optional[int]:
    """diffusers' rule for `height=None`: the denoiser's `sample_size`, else the pipeline's own
    `default_sample_size` (FluxPipeline's 128), times the VAE's scale factor."""
    channels = _config(folder / "vae").get("block_out_channels")
    if not isinstance(channels, list) or not channels:
        return None
    sizes = (_config(folder / denoiser).get("sample_size") for denoiser in DENOISERS)
    sample_size = next((size for size in sizes if isinstance(size, int)), None) or _class_sample_size(runtime)
    return None if sample_size is None else sample_size * 2 ** (len(channels) - 1)


def _class_sample_size(runtime: Optional[type]) -> Optional[int]:
    """The number a pipeline's `__init__` sets `self.default_sample_size` to when its denoiser's config has none
    (`= 128`, or the `else 128` of `config.sample_size if ... else 128`), read from its source, never run."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(runtime.__init__)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Attribute) and target.attr ==
                                                "default_sample_size" for target in node.targets):
            numbers = [leaf.value for leaf in ast.walk(node.value) if isinstance(leaf, ast.Constant)
                       and type(leaf.value) is int]
            return numbers[-1] if numbers else None
    return None


def _config(component: Path) -> dict:
    from ..checkpoint.files import read_config_dict

    try:
        return read_config_dict(component)
    except PlacementError:  # absent or unreadable: this default stays unknown (the load reports the rest)
        return {}


def complete_call(planner: "TargetPlanner") -> list[str]:
    """Fill `planner.call`'s missing height and width with the pipeline's default size; returns the keys filled."""
    call = planner.call
    _check_strength(planner)
    missing = [key for key in ("height", "width") if call is not None and key not in call]
    if not missing:
        return []
    defaults = target_defaults(planner)
    if any(key not in defaults for key in missing):
        given = ", ".join("--" + _FLAGS.get(key, key).replace("_", "-") for key in call)
        raise LoadError(f"{given} plan(s) for a call, and {planner.target!r} has no default image size to "
                               "make it at: give --height and --width too.")
    planner.call = {**{key: call.get(key, defaults.get(key)) for key in ("height", "width")}, **call}
    return missing


def _check_strength(planner: "TargetPlanner") -> None:
    """`--strength` on a pipeline whose call takes none (it makes images from noise): said in flag words, before
    call= refuses the keyword in Python's."""
    if not planner.call or "strength" not in planner.call:
        return
    folder = planner.folder()
    with quiet(preload=hf_libraries(folder)):
        runtime = _runtime_class(folder, folder_pipeline_class(folder))
    if runtime is not None and "strength" not in inspect.signature(runtime.__call__).parameters:
        raise LoadError(f"--strength {planner.call['strength']}: {runtime.__name__} does not start from an image (its "
                        "call takes no strength), so no share of its steps is skipped; leave --strength out, or plan "
                        "an image-to-image or inpainting pipeline.")


def target_defaults(planner: "TargetPlanner") -> dict[str, Any]:
    folder = planner.folder()
    with quiet(preload=hf_libraries(folder)):
        return default_call(folder, folder_pipeline_class(folder))


_FLAGS = {"num_inference_steps": "steps"}  # call keys whose flag has another name


def resolve_budgets_arg(budgets: BudgetsArg | None, flag: str) -> dict | None:
    """A parsed budgets flag as exact bytes per device; a bad size or a device named twice names the flag."""
    if budgets is None:
        return None
    resolved: dict = {}
    spelled: dict = {}
    for device_text, size_text in budgets.items:
        try:
            device, size = normalize_device(device_text), parse_budget(size_text)
        except PlacementError as error:
            example = "" if "did you mean" in str(error) else f" Write e.g. {flag} {BUDGET_EXAMPLE}."
            raise LoadError(f"{flag} {budgets.text}: {error}{example}") from error
        if device in resolved:
            raise LoadError(
                f"{flag} {budgets.text} names {device_label(device)} twice ({spelled[device]!r} and {device_text!r}); "
                "keep one."
            )
        resolved[device], spelled[device] = size, device_text
    warn_zero_budgets([device for device, size in resolved.items() if size == 0])
    return exact_budgets(resolved)


# Library messages speak Python (they serve API users); on the command line the same advice names flags.
_FLAG_SPELLINGS = [
    (re.compile(r"max_memory=\{0: '24GiB', \.\.\.\}"), "--max-memory 0=24GiB,..."),
    (re.compile(r"torch_dtype=torch\.bfloat16"), "--dtype bf16"),
    (re.compile(r"max_memory\['disk'\]"), "the disk= budget in --max-memory"),
    (re.compile(r"offload_folder=\.\.\."), "--offload-folder DIR"),
    (re.compile(r"device_map='(\w+)'"), r"--strategy \1"),
    (re.compile(r"\bmax_memory\b"), "--max-memory"),
    (re.compile(r"\boffload_folder\b"), "--offload-folder"),
    (re.compile(r"\bactivations= \(or call=\)"), "--height and --width"),
    (re.compile(r"\bstrength=([\d.]+):"), r"--strength \1:"),
    (re.compile(r"\bleave strength out\b"), "leave --strength out"),
    (re.compile(r"\(gpu=\)"), "(--gpu)"),
]


def in_flag_names(text: str) -> str:
    for pattern, replacement in _FLAG_SPELLINGS:
        text = pattern.sub(replacement, text)
    return text


@contextmanager
def warnings_once(already_shown: list[str] | None = None) -> Iterator[list[str]]:
    """The library's warnings from the block, each distinct one printed once in flag names, less `already_shown`."""
    caught_messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught_messages
    shown = set(already_shown or []) | set(caught_messages)
    for warning in caught:
        message = str(warning.message)
        if message not in shown:
            shown.add(message)
            print(f"warning: {in_flag_names(message)}", file=sys.stderr)
