"""Call capture: what one call of a diffusers pipeline runs of each component, learned by running the pipeline's
own `__call__` once with each module's forward a recorder that answers outputs of the right shapes (estimated on
fake tensors, which is also the activation estimate). So every diffusers class is planned for the call it really
makes without code naming it; the few things capture cannot see by itself are the overrides below. What is passed
to the `__call__` (defaults, stand-ins, the user's objects detached) is `arguments.py`'s; what it may take of the
host's memory, `host_memory.py`'s."""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from placement import estimate_call
from placement.activations import ActivationEstimateError, CallEstimate
from placement.activations.fake_tensors import map_tensors, sized_by_values
from placement.activations.fallback import EstimateFallback, current_fallbacks
from placement.activations.isolation import loggers_at_error
from placement.unit_order import record_module_order

from ...errors import CallSpecError
from .arguments import call_arguments, call_parameters, detached, missing_inputs, small_default_call
from .arguments import recorded_call  # noqa: F401 (where planning and the e2e tests import it)
from .host_memory import HostRoom, check_host_room
from .latent_output import latents_shaped_output
from .vae_techniques import RequiredTechnique, techniques_on, techniques_to_try


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
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one thread while the call is captured. Its real tensors are the pipeline's own small ones
    (latents, timesteps, the scheduler's steps on the stand-in outputs) and the components run on fake tensors:
    an op of a few MiB split over OpenMP threads costs more in their fork and join than in its arithmetic, and on
    a loaded machine the threads spin waiting for cores (28 scheduler steps: ~1.2 s of CPU with 2 threads, ~0.05
    s with one). Every op, and so every estimate, is the same; torch's setting is restored after."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


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
    # Per VAE, a technique its own code refuses this call without (`vae_techniques.RequiredTechnique`): its
    # example calls and peak are the ones with it on.
    required: dict[str, RequiredTechnique] = field(default_factory=dict)

    def work_per_run(self) -> dict[str, tuple[int, int]]:
        """(FLOPs, bytes touched) per run: the call's total over the component's runs."""
        return {name: (flops // max(self.runs.get(name, 1), 1), touched // max(self.runs.get(name, 1), 1))
                for name, (flops, touched) in self.work.items()}


def capture_call(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any] | None, *,
                 dtype_of: Callable[[str], torch.dtype | None]) -> CapturedCall:
    """Run `pipe(**call)` with each of `modules` replaced by a recorder; `dtype_of(name)`: each one's run dtype.
    `call` None: the pipeline's default call at a small size (`small_default_call`: for its runs), else at its
    own sizes where it refuses the small one. Image inputs the call leaves out stay out unless the pipeline cannot
    run without them (then blank ones of the call's size)."""
    known: dict[tuple, _Estimated] = {}  # estimates shared by the attempts: each distinct call is estimated once
    if call is not None:
        check_host_room(pipe, modules, call)
    else:
        try:
            return _captured_with_inputs(pipe, modules, small_default_call(pipe), dtype_of, known)
        except CallSpecError:
            call = {}
    return _captured_with_inputs(pipe, modules, call, dtype_of, known)


def _captured_with_inputs(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any],
                          dtype_of: Callable[[str], torch.dtype | None], known: dict) -> CapturedCall:
    """The call as given; again with stand-ins for the image inputs it leaves out where the pipeline fails
    without them (which it says by failing: most refuse in their own checks, some fail further in)."""
    arguments = call_arguments(type(pipe), call)
    outcome = _captured(pipe, modules, arguments, dtype_of, known)
    if isinstance(outcome, CallSpecError) and missing_inputs(type(pipe), arguments):
        outcome = _captured(pipe, modules, call_arguments(type(pipe), call, with_stand_ins=True), dtype_of, known)
    if isinstance(outcome, CallSpecError):
        raise outcome from outcome.__cause__
    return outcome


def _captured(pipe: Any, modules: Mapping[str, nn.Module], arguments: Mapping[str, Any],
              dtype_of: Callable[[str], torch.dtype | None], known: dict) -> CapturedCall | CallSpecError:
    """The call captured, or the pipeline's own code failing on it as the error to raise (ours are raised)."""
    recorder = _Recorder(modules, dtype_of, known, room=HostRoom.now(type(pipe).__name__))
    with contextlib.ExitStack() as stack:
        # The libraries' warnings about the call (a long prompt truncated, which the default prompt is on purpose)
        # say nothing about the plan.
        for context in (optional_text_cleaning(pipe), progress_bar_off(pipe), blank_results_not_converted(pipe),
                        _executing_on_the_cpu(pipe), loggers_at_error("diffusers", "transformers"), one_thread()):
            stack.enter_context(context)
        for name, module in modules.items():
            stack.enter_context(recorder.standing_in(name, module))
        try:  # the user's random state is left as it was: the capture's latents draw from a fork of it
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                pipe(**detached(arguments))
        except CallSpecError:
            raise
        except ActivationEstimateError as error:
            raise _no_steps(pipe, arguments, error) or error
        except Exception as error:
            failure = _no_steps(pipe, arguments, error) or _capture_failure(pipe, recorder, error)
            failure.__cause__ = error
            return failure
    return recorder.result()


@dataclass(frozen=True, kw_only=True)
class _Estimated:
    """One distinct call of a component, estimated on fake tensors: its example, output, work, peak, order."""

    example: ExampleCall
    output: Any
    work: tuple[int, int]
    peak: int
    order: list[str]


class _Recorder:
    def __init__(self, modules: Mapping[str, nn.Module], dtype_of: Callable[[str], torch.dtype | None],
                 known: dict[tuple, _Estimated], *, room: HostRoom) -> None:
        self.modules, self.dtype_of, self.known, self.room = modules, dtype_of, known, room
        self.used: dict[str, dict[tuple, None]] = {}  # per component, its distinct calls in the order first made
        self.work: dict[str, tuple[int, int]] = {}  # component -> FLOPs, bytes touched, over all its calls
        self.runs: Counter = Counter()
        self.last: str | None = None  # the component called last (for an error's message)
        self.guessed: dict[str, str] = {}  # component -> why its output was guessed (`_latents_shaped`)
        self.required: dict[str, RequiredTechnique] = {}  # component -> what it cannot run without
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
        if key not in self.known:
            example = ExampleCall(args=meta_args, kwargs=meta_kwargs, method=method,
                                  keep_values=sized_by_values(module))  # its output's shape: its own code's
            with record_module_order(module) as order:
                example, estimate = self._estimate(name, module, example)
            self.known[key] = _Estimated(example=example, output=estimate.output, peak=estimate.peak_bytes,
                                         work=(estimate.flops, estimate.bytes_touched), order=order)
        self.used.setdefault(name, {})[key] = None
        estimated = self.known[key]
        leaves = [leaf for leaf in tree_flatten(estimated.output)[0] if isinstance(leaf, torch.Tensor)]
        self.room.check(sum(leaf.numel() * leaf.element_size() for leaf in leaves), f"{name}.{method}'s output")
        flops, touched = self.work.get(name, (0, 0))
        self.work[name] = (flops + estimated.work[0], touched + estimated.work[1])
        return map_tensors(lambda tensor: torch.zeros(tensor.shape, dtype=tensor.dtype, device=_CPU),
                           estimated.output)

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
            empty = _empty_tokens(name, example)
            if empty is not None:
                raise empty from error
            answer = self._with_required_technique(name, module, example, error) \
                or self._latents_shaped(name, module, example, error)
            if answer is None:
                raise error.for_component(name) from error
            return example, answer
        finally:
            self._inside = False

    def _with_required_technique(self, name: str, module: nn.Module, example: ExampleCall,
                                 error: ActivationEstimateError) -> CallEstimate | None:
        """A VAE whose own code refuses the call with its techniques off but runs it with one on (Allegro's
        decodes only in tiles): estimated with it on, and the technique recorded as required (the plan turns it
        on). None where no technique makes the call run."""
        if not error.model_failure or example.method not in _ENTRY_METHODS:
            return None
        for technique in techniques_to_try(module):
            try:
                with techniques_on(module, {technique}):
                    estimate = self._run(module, example, self.dtype_of(name))
            except ActivationEstimateError:
                continue
            self.required[name] = RequiredTechnique(
                technique=technique, reason=f"{type(module).__name__}.{example.method} without {technique.value} "
                                            f"raises {error.cause}")
            return estimate
        return None

    def _latents_shaped(self, name: str, module: nn.Module, example: ExampleCall,
                        error: ActivationEstimateError) -> CallEstimate | None:
        """Where the model's own code fails on this call (even with its values guessed) and a weights-only
        fallback is allowed, a denoiser's answer: its activations not counted, its output its latents' shape
        (`latent_output`), the fallback recorded for the plan to say so. None where that does not apply."""
        fallbacks = current_fallbacks()
        if fallbacks is None or not error.model_failure:
            return None
        guessed = latents_shaped_output(module, example.method, example.args, example.kwargs, self.dtype_of(name))
        if guessed is None:
            return None
        fallbacks.add(EstimateFallback(module=weakref.ref(module), call=error.call, reason=error.cause,
                                       output_known=False, reads_values=error.reads_values,
                                       output_taken_from=guessed.taken_from))
        self.guessed[name] = f"{name}'s output was taken to be {guessed.taken_from}: {error.cause}"
        return CallEstimate(peak_bytes=0, output=guessed.output, fallback=error.cause)

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
        estimated = {name: [self.known[key] for key in keys] for name, keys in self.used.items()}
        return CapturedCall(calls={name: [known.example for known in found] for name, found in estimated.items()},
                            runs={name: count for name, count in self.runs.items() if count},
                            peaks={name: max(known.peak for known in found) for name, found in estimated.items()},
                            module_order={name: found[0].order for name, found in estimated.items()},
                            work=dict(self.work), required=dict(self.required))


def _empty_tokens(name: str, example: ExampleCall) -> CallSpecError | None:
    """Where a component failed on a token sequence of no tokens, the error that says why it had none."""
    leaves, _ = tree_flatten((example.args, dict(example.kwargs)))
    empty = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point()
                  and leaf.dim() >= 2 and leaf.shape[-1] == 0), None)
    if empty is None:
        return None
    return CallSpecError(
        f"call=: {name} was called on a sequence of no tokens ({str(empty.dtype).removeprefix('torch.')}"
        f"{list(empty.shape)}), which it cannot run on, in this call as in diffusers' own: the tokenizer gave no "
        "token for a prompt (most pipelines' default negative prompt is \"\"; the model's published tokenizer "
        "adds its special tokens to every text, this one adds none). Load the model's own tokenizer, or give a "
        "non-empty negative_prompt."
    )


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


def _no_steps(pipe: Any, arguments: Mapping[str, Any], error: Exception) -> CallSpecError | None:
    """Where an img2img or inpaint call's `strength` leaves no denoising step (diffusers' StableDiffusion
    img2img then fails on an empty batch, in the VAE's decode), the error that says so; None for other failures."""
    parameters = call_parameters(type(pipe))
    if "strength" not in parameters or "num_inference_steps" not in parameters:
        return None
    strength = arguments.get("strength", parameters["strength"].default)
    steps = arguments.get("num_inference_steps", parameters["num_inference_steps"].default)
    if not isinstance(strength, (int, float)) or not isinstance(steps, int) or not 0 <= strength <= 1 \
            or steps < 1 or steps * strength >= 1:
        return None
    name = type(pipe).__name__
    cause = error.cause if isinstance(error, ActivationEstimateError) else _reason(error)
    remedy = "a strength above 0" if strength == 0 else \
        f"a strength of at least {1 / steps:.3g} or at least {math.ceil(1 / strength)} num_inference_steps"
    return CallSpecError(
        f"call= for {name}: strength={strength} of num_inference_steps={steps} leaves no denoising step "
        f"(int({steps} x {strength}) = 0), and {name}.__call__ fails on such a call ({cause}). Give {remedy}."
    )


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _capture_failure(pipe: Any, recorder: _Recorder, error: Exception) -> CallSpecError:
    """The pipeline refused the call (its own checks: a ValueError), or its code could not run on stand-ins: the
    message says which, where in the pipeline's code, and after which component."""
    name = type(pipe).__name__
    reason = _reason(error)
    if isinstance(error, ValueError) and not recorder.guessed:  # after a guessed output: maybe the guess's
        return CallSpecError(f"call= for {name}: {name}.__call__ refuses this call ({reason}). Change call= as it "
                             "says.")
    where = _pipeline_frame(error)
    after = f" after {recorder.last}" if recorder.last else " before any component ran"
    guessed = "".join(f"; {why}" for why in recorder.guessed.values())
    return CallSpecError(
        f"call= for {name}: its __call__ could not run on stand-in components to plan for the call ({reason}, "
        f"at {where}{after}{guessed}). Plan without call= (weights only), or give the pipeline an "
        "`activation_inputs(**call)` method describing each component's inputs."
    )


def _pipeline_frame(error: BaseException) -> str:
    """The innermost frame of the error in diffusers' pipeline code (else the innermost one), as file:line."""
    frames = traceback.extract_tb(error.__traceback__)
    chosen = next((frame for frame in reversed(frames) if "diffusers" in frame.filename), frames[-1] if frames
                  else None)
    return "unknown" if chosen is None else f"{Path(chosen.filename).name}:{chosen.lineno} ({chosen.line})"
