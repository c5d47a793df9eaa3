"""Call capture: what one call of a diffusers pipeline runs of each component, learned by running the pipeline's
own `__call__` once with each module's forward a recorder that answers outputs of the right shapes (estimated on
fake tensors, which is also the activation estimate). So every diffusers class is planned for the call it really
makes without code naming it; the few things capture cannot see by itself are the overrides below."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import sys
import traceback
import types
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from PIL import Image
from torch import nn
from torch.utils._pytree import tree_flatten

from placement import estimate_call
from placement.activations import ActivationEstimateError
from placement.activations.fake_tensors import map_tensors, sized_by_values
from placement.activations.isolation import loggers_at_error
from placement.unit_order import record_module_order

from ...errors import CallSpecError


OUR_KEYS = ("batch_size",)
# One spelling for every pipeline: a video pipeline's `num_videos_per_prompt` taken as `num_images_per_prompt` too.
ALIASES = {"num_images_per_prompt": "num_videos_per_prompt"}
# The prompt planned for when call= gives none: long enough that every tokenizer truncates it at the pipeline's
# maximum sequence length, so pipelines that drop padding tokens (Qwen-Image, Z-Image) plan for their longest
# text, as those that pad to the maximum do.
DEFAULT_PROMPT = " ".join(["a lighthouse on a rocky coast at dusk, waves, gulls, warm light,"] * 64)


def call_arguments(pipeline_class: type, call: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the `__call__` that `call` describes."""
    parameters = {name: parameter for name, parameter in inspect.signature(pipeline_class.__call__).parameters.items()
                  if name != "self" and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                               inspect.Parameter.VAR_KEYWORD)}
    name = pipeline_class.__name__
    call = {ALIASES[key] if key not in parameters and ALIASES.get(key) in parameters else key: value
            for key, value in call.items()}
    _check_keys(name, call, parameters)
    arguments = {key: value for key, value in call.items() if key in parameters}
    batch = call.get("batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CallSpecError(f"call= for {name}: batch_size must be a positive int (the number of prompts), got "
                            f"{batch!r}.")
    if "prompt" in parameters and arguments.get("prompt") is None and "prompt_embeds" not in arguments:
        arguments["prompt"] = DEFAULT_PROMPT if batch == 1 else [DEFAULT_PROMPT] * batch
    elif batch != 1 and isinstance(arguments.get("prompt"), str):
        arguments["prompt"] = [arguments["prompt"]] * batch
    if "output_type" in parameters and "output_type" not in call:
        arguments["output_type"] = "pt"  # tensors out: no conversion to PIL images of a blank result
    for key in STAND_IN_INPUTS:
        if key in parameters:
            value = arguments.get(key)
            if value is None or _is_size(value):
                arguments[key] = _stand_in(name, key, value, call, parameters)
    return arguments


def _check_keys(name: str, call: Mapping[str, Any], parameters: Mapping[str, inspect.Parameter]) -> None:
    sizes_images = any(key in parameters for key in STAND_IN_INPUTS)
    known = set(parameters) | set(OUR_KEYS) | ({"height", "width", "num_frames"} if sizes_images else set())
    unknown = [key for key in call if key not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CallSpecError(
            f"call= for {name}: unknown keyword {key!r}{hint}; call= takes what {name}.__call__ takes "
            f"({', '.join(sorted(parameters))}), and batch_size, vae_tiling, vae_slicing."
        )


def _is_size(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _stand_in(name: str, key: str, value: Any, call: Mapping[str, Any],
              parameters: Mapping[str, inspect.Parameter]) -> Any:
    """A blank input of the size `value` gives, else of the call's height and width (and frames for a video)."""
    video = key in VIDEO_INPUTS and "num_frames" in parameters
    if value is None:
        missing = [size for size in ("height", "width") if not isinstance(call.get(size), int)]
        if missing:
            raise CallSpecError(
                f"call= for {name} needs {' and '.join(missing)} to plan for its {key!r} input (or give it: "
                f"{key}=({'frames, ' if video else ''}height, width) or the real {'frames' if video else 'image'})."
            )
        frames = call.get("num_frames", parameters.get("num_frames") and parameters["num_frames"].default)
        value = (frames, call["height"], call["width"]) if video else (call["height"], call["width"])
    if len(value) != (3 if video else 2) or min(value) < 1:
        raise CallSpecError(f"call= for {name}: {key}={value!r} is not a size; give "
                            f"({'frames, ' if video else ''}height, width) in pixels.")
    mode = "L" if "mask" in key else "RGB"
    if video:
        frames, height, width = value
        return [Image.new(mode, (width, height)) for _ in range(frames)]
    height, width = value
    return Image.new(mode, (width, height))


def recorded_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """`call` as a plan records it (JSON): an image as [height, width], frames as [frames, height, width], a tensor
    as its shape; numbers, strings and their lists as they are; anything else by its repr."""
    return {key: _recorded(value) for key, value in call.items()}


def _recorded(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Image.Image):
        return [value.height, value.width]
    shape = getattr(value, "shape", None)
    if shape is not None:
        return list(shape)
    if isinstance(value, (list, tuple)):
        items = [_recorded(item) for item in value]
        if items and all(isinstance(item, list) and len(item) == 2 and isinstance(value[0], Image.Image)
                         for item in items):
            return [len(items), *items[0]]  # frames of one size
        return items
    if isinstance(value, Mapping):
        return {str(key): _recorded(item) for key, item in value.items()}
    return repr(value)


# Keys of `call=` that say how many times the denoiser runs, not what it runs on (our pipelines' `runs_per_call`).
RUN_KEYS = ("num_inference_steps", "strength")
# Keys of `call=` that choose memory techniques rather than sizes (`pipelines.loading.memory_techniques`).
TECHNIQUE_KEYS = ("vae_tiling", "vae_slicing")


@dataclass(frozen=True, kw_only=True)
class ExampleCall:
    """One component's part of a pipeline call: `getattr(module, method)(*args, **kwargs)`, floating tensors on
    meta (integer ones may be real: ids and masks, whose values `keep_values` lets the estimate read)."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    method: str = "forward"
    keep_values: bool = False  # its integer inputs' values size tensors (`placement.estimate_call`)

    def estimate(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> int:
        """Peak activation bytes of this call on `module` (see `placement.estimate_call`)."""
        return estimate_call(module, self.args, dict(self.kwargs), method=self.method, dtype=dtype,
                             keep_values=self.keep_values).peak_bytes


# Inputs a call needs that `call=` may leave out: without them an img2img, inpaint, ControlNet or image-to-video
# pipeline refuses to run (or, for an optional conditioning image such as FLUX Kontext's, plans a smaller call
# than the one it is for). A blank one of the call's size costs what a real one does: only sizes matter.
STAND_IN_INPUTS = ("image", "mask_image", "control_image", "video", "mask")
# Of those, the ones a video pipeline takes as a list of frames (Wan VACE's `video` and `mask`).
VIDEO_INPUTS = ("video", "mask")


@contextlib.contextmanager
def blank_results_not_converted(pipe: Any) -> Iterator[None]:
    """Post-processing (PIL or numpy conversion) runs no component and costs seconds for a video: skipped."""
    patched = []
    for processor in list(vars(pipe).values()):
        for method in ("postprocess", "postprocess_video"):
            if callable(getattr(type(processor), method, None)) and not isinstance(processor, type):
                setattr(processor, method, _returned_as_is)
                patched.append((processor, method))
    try:
        yield
    finally:
        for processor, method in patched:
            vars(processor).pop(method, None)


def _returned_as_is(*args: Any, **kwargs: Any) -> Any:
    """The processed thing itself: the first argument, or the keyword naming it (`video=`, `image=`)."""
    return args[0] if args else kwargs.get("video", kwargs.get("image"))


@contextlib.contextmanager
def optional_text_cleaning(pipe: Any) -> Iterator[None]:
    """diffusers' Wan image-to-video and VACE pipelines call `ftfy.fix_text` without checking that ftfy is installed;
    cleaning changes no shape, so the capture leaves the text as it is."""
    module = sys.modules.get(type(pipe).__module__)
    missing = module is not None and "ftfy" not in vars(module) and _mentions(module, "ftfy.fix_text")
    if missing:
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    try:
        yield
    finally:
        if missing:
            del module.ftfy


def _mentions(module: types.ModuleType, text: str) -> bool:
    source = getattr(module, "__file__", None)
    if not source:
        return False
    try:
        with open(source, encoding="utf-8") as file:
            return text in file.read()
    except OSError:
        return False


@contextlib.contextmanager
def progress_bar_off(pipe: Any) -> Iterator[None]:
    """No step bar while planning: the user sees the plan, not a bar of a call that is not really run."""
    saved = dict(getattr(pipe, "_progress_bar_config", {}) or {})
    pipe.set_progress_bar_config(disable=True)
    try:
        yield
    finally:
        pipe._progress_bar_config = saved


_ENTRY_METHODS = ("encode", "decode")  # besides forward: what pipelines call on a VAE
_CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class CapturedCall:
    """One call of a pipeline as its `__call__` made it: per component, one example call per distinct input
    signature, its runs, its activation peak (no technique on) and the order its submodules ran in."""

    calls: dict[str, list[ExampleCall]]
    runs: dict[str, int]
    peaks: dict[str, int]
    module_order: dict[str, list[str]] = field(default_factory=dict)
    # Per component, what all its calls of this pipeline call compute and touch together: (FLOPs, bytes touched),
    # from each distinct call's estimate times how often it was made (`placement.estimate_call(...).flops`).
    work: dict[str, tuple[int, int]] = field(default_factory=dict)

    def work_per_run(self) -> dict[str, tuple[int, int]]:
        """(FLOPs, bytes touched) per run: the call's total over the component's runs."""
        return {name: (flops // max(self.runs.get(name, 1), 1), touched // max(self.runs.get(name, 1), 1))
                for name, (flops, touched) in self.work.items()}


def capture_call(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                 dtype_of: Callable[[str], torch.dtype | None]) -> CapturedCall:
    """Run `pipe(**call)` with each of `modules` replaced by a recorder; `dtype_of(name)`: each one's run dtype."""
    arguments = call_arguments(type(pipe), call)
    recorder = _Recorder(modules, dtype_of)
    with contextlib.ExitStack() as stack:
        # The libraries' warnings about the call (a long prompt truncated, which the default prompt is on purpose)
        # say nothing about the plan.
        for context in (optional_text_cleaning(pipe), progress_bar_off(pipe), blank_results_not_converted(pipe),
                        _executing_on_the_cpu(pipe), loggers_at_error("diffusers", "transformers")):
            stack.enter_context(context)
        for name, module in modules.items():
            stack.enter_context(recorder.standing_in(name, module))
        try:  # the user's random state is left as it was: the capture's latents draw from a fork of it
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                pipe(**arguments)
        except (ActivationEstimateError, CallSpecError):
            raise
        except Exception as error:
            raise _capture_failure(pipe, recorder, error) from error
    return recorder.result()


class _Recorder:
    def __init__(self, modules: Mapping[str, nn.Module], dtype_of: Callable[[str], torch.dtype | None]) -> None:
        self.modules, self.dtype_of = modules, dtype_of
        self.examples: dict[str, dict[tuple, ExampleCall]] = {}
        self.outputs: dict[tuple, Any] = {}
        self.peaks: dict[str, int] = {}
        self.work: dict[str, tuple[int, int]] = {}  # component -> FLOPs, bytes touched, over all its calls
        self.work_of: dict[tuple, tuple[int, int]] = {}  # a distinct call -> its FLOPs, bytes touched
        self.orders: dict[str, list[str]] = {}
        self.runs: Counter = Counter()
        self.last: str | None = None  # the component called last (for an error's message)
        self._inside = False  # True while a component runs on fake tensors: its own calls go through

    @contextlib.contextmanager
    def standing_in(self, name: str, module: nn.Module) -> Iterator[None]:
        methods = ["forward", *(m for m in _ENTRY_METHODS if callable(getattr(type(module), m, None)))]
        for method in methods:
            setattr(module, method, self._entry(name, module, method, getattr(module, method)))
        try:
            yield
        finally:
            for method in methods:
                vars(module).pop(method, None)

    def _entry(self, name: str, module: nn.Module, method: str, original: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            return self._answer(name, module, method, args, kwargs)
        return recorded

    def _answer(self, name: str, module: nn.Module, method: str, args: tuple, kwargs: dict) -> Any:
        self.last = f"{name}.{method}"
        self.runs[name] += method == "forward"
        # Floating inputs only matter by their shapes: on meta. Integer ones (ids, masks) keep their values,
        # small, for models that size tensors by them.
        meta_args, meta_kwargs = map_tensors(lambda t: t.to("meta") if t.is_floating_point() else t, (args, kwargs))
        key = (name, method, _signature(meta_args, meta_kwargs))
        if key not in self.outputs:
            example = ExampleCall(args=meta_args, kwargs=meta_kwargs, method=method,
                                  keep_values=sized_by_values(module))  # its output's shape: its own code's
            with record_module_order(module) as order:
                example, estimate = self._estimate(name, module, example)
            self.examples.setdefault(name, {})[key] = example
            self.outputs[key] = estimate.output
            self.work_of[key] = (estimate.flops, estimate.bytes_touched)
            self.peaks[name] = max(self.peaks.get(name, 0), estimate.peak_bytes)
            self.orders.setdefault(name, order)
        flops, touched = self.work.get(name, (0, 0))
        self.work[name] = (flops + self.work_of[key][0], touched + self.work_of[key][1])
        return map_tensors(lambda tensor: torch.zeros(tensor.shape, dtype=tensor.dtype, device=_CPU),
                           self.outputs[key])

    def _estimate(self, name: str, module: nn.Module, example: ExampleCall) -> tuple[ExampleCall, Any]:
        """The call run on fake tensors; again with its integer inputs' values when it reads them."""
        self._inside = True
        try:
            try:
                return example, self._run(module, example, self.dtype_of(name))
            except ActivationEstimateError as error:
                if example.keep_values or not _reads_values(error) or not _has_integer_inputs(example):
                    raise
                example = replace(example, keep_values=True)
                return example, self._run(module, example, self.dtype_of(name))
        except ActivationEstimateError as error:
            raise error.for_component(name) from error
        finally:
            self._inside = False

    @staticmethod
    def _run(module: nn.Module, example: ExampleCall, dtype):
        # The module's own methods while it is estimated: a wrapped `forward` would turn the estimate cache and
        # the block memo off (they skip calls only of modules whose code they can see).
        recorders = {name: vars(module).pop(name) for name in ("forward", *_ENTRY_METHODS) if name in vars(module)}
        try:
            return estimate_call(module, example.args, dict(example.kwargs), method=example.method, dtype=dtype,
                                 keep_values=example.keep_values)
        finally:
            vars(module).update(recorders)

    def result(self) -> CapturedCall:
        return CapturedCall(calls={name: list(found.values()) for name, found in self.examples.items()},
                            runs={name: count for name, count in self.runs.items() if count},
                            peaks=dict(self.peaks), module_order=dict(self.orders), work=dict(self.work))


def _reads_values(error: ActivationEstimateError) -> bool:
    """Whether the estimate failed because the model reads a tensor's values (`.tolist()`, `.item()`, a size)."""
    return "DataDependent" in error.cause or "data-dependent" in error.cause.lower()


def _has_integer_inputs(example: ExampleCall) -> bool:
    leaves, _ = tree_flatten((example.args, dict(example.kwargs)))
    return any(isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_meta
               for leaf in leaves)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What makes two calls the same estimate: structure, each tensor's shape, dtype and strides, and the other
    inputs' values (an int can size a reshape) except floats, which change values, not shapes."""
    leaves, spec = tree_flatten((args, kwargs))

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.stride())
        if isinstance(value, float):
            return "float"
        if value is None or isinstance(value, (bool, int, str)):
            return value
        return type(value).__qualname__

    return str(spec), tuple(leaf(value) for value in leaves)


@contextlib.contextmanager
def _executing_on_the_cpu(pipe: Any) -> Iterator[None]:
    """The pipeline's own tensors (latents, timesteps) on the CPU, not on its modules' meta device."""
    original = type(pipe)
    pipe.__class__ = _cpu_class(original)
    try:
        yield
    finally:
        pipe.__class__ = original


_CPU_CLASSES: dict[type, type] = {}


def _cpu_class(original: type) -> type:
    if original not in _CPU_CLASSES:
        cpu = property(lambda self: _CPU)
        _CPU_CLASSES[original] = type(original.__name__, (original,), {
            "_execution_device": cpu, "device": cpu, "__module__": original.__module__,
            "__doc__": f"{original.__name__}, its own tensors on the CPU while its call is captured."})
    return _CPU_CLASSES[original]


def _capture_failure(pipe: Any, recorder: _Recorder, error: Exception) -> CallSpecError:
    """The pipeline refused the call (its own checks: a ValueError), or its code could not run on stand-ins: the
    message says which, where in the pipeline's code, and after which component."""
    name = type(pipe).__name__
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if isinstance(error, ValueError):
        return CallSpecError(f"call= for {name}: {name}.__call__ refuses this call ({reason}). Change call= as it "
                             "says.")
    where = _pipeline_frame(error)
    after = f" after {recorder.last}" if recorder.last else " before any component ran"
    return CallSpecError(
        f"call= for {name}: its __call__ could not run on stand-in components to plan for the call ({reason}, "
        f"at {where}{after}). Plan without call= (weights only), or give the pipeline an "
        "`activation_inputs(**call)` method describing each component's inputs."
    )


def _pipeline_frame(error: BaseException) -> str:
    """The innermost frame of the error in diffusers' pipeline code (else the innermost one), as file:line."""
    frames = traceback.extract_tb(error.__traceback__)
    chosen = next((frame for frame in reversed(frames) if "diffusers" in frame.filename), frames[-1] if frames
                  else None)
    return "unknown" if chosen is None else f"{Path(chosen.filename).name}:{chosen.lineno} ({chosen.line})"
