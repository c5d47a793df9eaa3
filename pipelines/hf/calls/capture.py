"""Call capture: what one call of a diffusers pipeline runs of each component, learned by running the pipeline's
own `__call__` once on stand-ins.

The pipeline object is the real one (its tokenizers and scheduler, its modules built on meta). For the length
of the capture each module component's `forward` (and a VAE's `encode` / `decode`) is a recorder: it notes the
call's inputs, counts it, and answers with outputs of the right shapes and types, zeros on the CPU, computed by
running the real module on fake tensors (`placement.estimate_call`) once per distinct input signature, which is
also the call's activation estimate. The pipeline's own code does the rest for real on the CPU, at the call's
real sizes but with no model compute: prompts tokenized, latents packed, the scheduler's timesteps, guidance
batching or second passes, `strength`, image and mask preprocessing, ControlNets at every step, two experts
switching at a boundary timestep. So every diffusers class is planned for the call it really makes, without
code naming it, and a diffusers release that changes a `__call__` changes the plan with it. What this cannot
see by itself is in `overrides.py`.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from placement import estimate_call
from placement.activations import ActivationEstimateError
from placement.activations.fake_tensors import map_tensors, sized_by_values
from placement.unit_order import record_module_order

from ...errors import CallSpecError
from .arguments import call_arguments
from .overrides import blank_results_not_converted, libraries_quiet, optional_text_cleaning, progress_bar_off
from .spec import ExampleCall

_ENTRY_METHODS = ("encode", "decode")  # besides forward: what pipelines call on a VAE
_CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class CapturedCall:
    """One call of a pipeline as its `__call__` made it: per component, one example call per distinct input
    signature (on meta, for estimates), how many times its `forward` ran, its activation peak (the largest of
    its calls, no memory technique on), and the order its submodules ran in (splits are cut in it)."""

    calls: dict[str, list[ExampleCall]]
    runs: dict[str, int]
    peaks: dict[str, int]
    module_order: dict[str, list[str]] = field(default_factory=dict)
    # Per component, what all its calls of this pipeline call compute and touch together: (FLOPs, bytes touched),
    # from each distinct call's estimate times how often it was made (`placement.estimate_call(...).flops`).
    work: dict[str, tuple[int, int]] = field(default_factory=dict)

    def work_per_run(self) -> dict[str, tuple[int, int]]:
        """(FLOPs, bytes touched) per run: the call's total over the component's runs (its `forward`s; a VAE's
        decode counts as its one run)."""
        return {name: (flops // max(self.runs.get(name, 1), 1), touched // max(self.runs.get(name, 1), 1))
                for name, (flops, touched) in self.work.items()}


def capture_call(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                 dtype_of: Callable[[str], torch.dtype | None]) -> CapturedCall:
    """Run `pipe(**call)` with each of `modules` replaced by a recorder (module doc); `dtype_of(name)` is the dtype
    each component will run in."""
    arguments = call_arguments(type(pipe), call)
    recorder = _Recorder(modules, dtype_of)
    with contextlib.ExitStack() as stack:
        for context in (optional_text_cleaning(pipe), progress_bar_off(pipe), blank_results_not_converted(pipe),
                        _executing_on_the_cpu(pipe), libraries_quiet()):
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
        """The call run on fake tensors; again with its integer inputs' values when it reads them (module doc of
        `placement.activations.estimate`)."""
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
    """What makes two calls of a component the same estimate: the inputs' structure, each tensor's shape, dtype
    and strides, and the values of the other inputs (an int can size a reshape) except floats (a timestep, a
    scale: they change values, not shapes)."""
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
    """The pipeline's own tensors (latents, timesteps, masks) on the CPU: its modules are on meta, where diffusers
    would otherwise make them (`_execution_device` is the first module's device)."""
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
