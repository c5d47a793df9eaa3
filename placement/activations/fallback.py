"""When a module's call cannot run on fake tensors, a plan need not be refused: within `weights_only_fallback()`,
an estimate that fails for a reason that is the model's answers "activations not counted" (a peak of 0, stated)
instead of raising, and the context records which module, which call and why, for the plan to say so.

The model's reasons, and only those (a bug of ours must still raise): an op that needs tensor values
(`if mask.any():`, `.item()`: fake tensors have none), an op fake tensors do not support, and a shape error raised
by torch or by the model's own code (not by this library's). Anything else (a TypeError, an AttributeError, an error
raised in this library) is raised as before.

A caller that needs the call's output (the capture of a pipeline's `__call__` passes it to the next component) gets
one from a second run in which each value the model reads is guessed (`ValuesGuessed`): the output's shapes, and
what that run computes (its FLOPs, for the time model), follow the guessed branch; its memory is not used. When even
that run fails, there is no output: with `outputs_needed` the estimate raises as without the fallback, unless its
caller knows the output from the inputs (a pipeline capture: a denoiser's prediction has its latents' shape) and
adds the record itself, with `output_taken_from` saying so.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode

# Fake tensors' own refusals: the op needs values, has an output sized by values, or has no fake kernel.
_FAKE_REFUSALS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                  UnsupportedFakeTensorException)
_VALUE_REFUSALS = (DataDependentOutputException, DynamicOutputShapeException)
# Symbolic shapes' refusal of a branch on data, looked up only once its module is loaded (it imports sympy,
# half a second `import placement` does not need; an error of its type cannot exist before).
_SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"
# What torch's kernels and the model's shape checks raise for shapes that do not fit.
_SHAPE_ERRORS = (RuntimeError, ValueError, IndexError, NotImplementedError, AssertionError)
_TORCH = Path(torch.__file__).resolve().parent
_LIBRARY = Path(__file__).resolve().parents[2]
_ESTIMATOR = Path(__file__).resolve().parent  # this package: its dispatch modes sit between the model and torch
_OWN_PACKAGES = tuple(_LIBRARY / name for name in ("placement", "hooks", "pipelines"))
# Our stand-in for fused attention checks shapes as torch's kernel does: its errors are the model's shapes.
_SHAPE_CHECKING_STAND_INS = (_ESTIMATOR / "fake_tensors.py",)


def is_model_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a call on fake tensors, is the model's (module doc), not a bug of ours."""
    if isinstance(error, (*_FAKE_REFUSALS, *_guard_errors())):
        return True
    if not isinstance(error, _SHAPE_ERRORS):
        return False
    files = [Path(frame.filename).resolve() for frame in traceback.extract_tb(error.__traceback__)]
    if not files or not (_inside(files[-1], _TORCH) or files[-1] in _SHAPE_CHECKING_STAND_INS
                         or _models_code(files[-1])):
        return False
    caller = next((file for file in reversed(files) if not _inside(file, _TORCH) and not _inside(file, _ESTIMATOR)),
                  None)
    return caller is not None and _models_code(caller)


def reads_values(error: BaseException) -> bool:
    """Whether `error` says the call needs tensor values (a `.tolist()`, a branch on data, a value-sized output)."""
    return isinstance(error, (*_VALUE_REFUSALS, *_guard_errors()))


def _guard_errors() -> tuple[type, ...]:
    module = sys.modules.get(_SYMBOLIC_SHAPES)
    return () if module is None else (module.GuardOnDataDependentSymNode,)


def _inside(file: Path, directory: Path) -> bool:
    return file.is_relative_to(directory)


def _models_code(file: Path) -> bool:
    """Code of a model: anything outside this library, and this library's own model classes."""
    if not any(_inside(file, package) for package in _OWN_PACKAGES):
        return True
    return "models" in file.relative_to(_LIBRARY).parts


@dataclass(frozen=True, kw_only=True)
class EstimateFallback:
    """One estimate that fell back to weights only: the module, its call, and why it could not be estimated."""

    module: "weakref.ref[nn.Module]" = field(repr=False)
    call: str  # e.g. "HunyuanVideo15Transformer3DModel.forward on inputs (...)"
    reason: str  # the failure, one line: "DataDependentOutputException: aten._local_scalar_dense.default"
    output_known: bool  # whether a run with guessed values gave the call's output (module doc)
    reads_values: bool = False  # the failure is that the call reads tensor values
    # Where neither run gave the output and the caller took it from the inputs instead (a denoiser's prediction
    # shaped as its latents): what it was taken from, for a person.
    output_taken_from: str = ""

    @property
    def explanation(self) -> str:
        """Why, for a person: the call, the failure, and in words what it means."""
        if self.reads_values:
            words = ("; its code reads tensor values (a branch or a size taken from data), which an estimate on "
                     "fake tensors does not have")
        elif any(refusal.__name__ in self.reason for refusal in _FAKE_REFUSALS):
            words = "; an op fake tensors cannot run"
        else:  # a shape error of torch's or of the model's code: its own run of these shapes meets it too
            words = "; a shape error in the model's own code, which a real run of this call may raise too"
        taken = (f"; its output was taken to be {self.output_taken_from}, and its compute is not in the predicted "
                 "time") if self.output_taken_from else ""
        return f"its call {self.call} could not be estimated ({self.reason}{words}){taken}"


class Fallbacks:
    """What `weights_only_fallback` collected: each failed estimate, once per (module, call)."""

    def __init__(self, *, outputs_needed: bool) -> None:
        self.outputs_needed = outputs_needed
        self.records: list[EstimateFallback] = []

    def add(self, record: EstimateFallback) -> None:
        if not any(known.module() is record.module() and known.call == record.call for known in self.records):
            self.records.append(record)

    def of(self, module: nn.Module) -> list[EstimateFallback]:
        """The fallbacks of `module`'s calls."""
        return [record for record in self.records if record.module() is module]


_current: ContextVar[Fallbacks | None] = ContextVar("placement_estimate_fallbacks", default=None)


def current_fallbacks() -> Fallbacks | None:
    """The collector of the innermost `weights_only_fallback` entered (None: estimates raise)."""
    return _current.get()


@contextlib.contextmanager
def weights_only_fallback(*, outputs_needed: bool = False) -> Iterator[Fallbacks]:
    """Within it, an estimate that fails for a reason of the model's falls back to weights only (module doc);
    the fallbacks are collected, and passed on to an enclosing collector on exit."""
    outer = _current.get()
    collected = Fallbacks(outputs_needed=outputs_needed)
    token = _current.set(collected)
    try:
        yield collected
    finally:
        _current.reset(token)
        if outer is not None:
            for record in collected.records:
                outer.add(record)


class ValuesGuessed(TorchDispatchMode):
    """A dispatch mode (entered innermost, above the fake mode) in which a value read from a tensor is guessed
    rather than refused (before the FLOP tally decomposes `bool(t)` into a scalar read): a scalar is true/one, a
    `nonzero` or a boolean mask finds every element nonzero (the largest output)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.is_nonzero.default:
            return True
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            tensor = args[0]
            if tensor.dtype is torch.bool:
                return True
            return 1.0 if tensor.is_floating_point() else 1
        if func is torch.ops.aten.nonzero.default:
            return _every_position(args[0])
        if func in _MASKED and any(_is_mask(index) for index in args[1]):
            return func(args[0], _positions(args[1]), *args[2:], **kwargs)
        return func(*args, **kwargs)


# Ops that take boolean masks among their indices (`x[mask]`, `x[mask] = v`): given each position instead.
_MASKED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _every_position(tensor: torch.Tensor) -> torch.Tensor:
    """What `nonzero` gives when every element is nonzero: its largest output."""
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


def _positions(indices) -> list:
    """`indices` with each mask replaced by the index tensors of all its positions (one per masked dim)."""
    replaced = []
    for index in indices:
        if _is_mask(index):
            replaced += [torch.empty(index.numel(), dtype=torch.long, device=index.device)] * index.dim()
        else:
            replaced.append(index)
    return replaced
