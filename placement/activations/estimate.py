"""estimate_call / estimate_activations: the peak memory one call of a module adds on top of its weights, and
what it returns, without memory.

The call runs for real, every op of the module's Python code, but on fake tensors (`FakeTensorMode`), so a
FLUX-size DiT on `meta` "runs" at 1024x1024 on a laptop; `LiveStorageTracker` keeps the peak of live storage
bytes (inputs, intermediates, output; not weights). Not counted: allocator rounding, cuBLAS/cuDNN workspaces,
the CUDA context (the planner adds an overhead for those), and temporaries private to one composite op seen
whole under inference mode. `measure_activations` is the reference: the same quantity measured on a real run
with torch's own `MemTracker`, for tests and benchmarks on small configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torch import nn
import torch._subclasses.fake_tensor as fake_tensor_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map_only

from .fallback import EstimateFallback, ValuesGuessed, current_fallbacks, is_model_failure, reads_values
from .fake_tensors import FusedAttentionAccounting, MetaConstants, shape_only_stand_ins, to_meta
from .isolation import accelerate_hooks_bypassed, collection_paused, module_state_kept, torch_silenced
from .memo import BlockMemo, CachedCall, cache_key, cached, memo_enabled, remember
from .progress import estimate_started
from .tracking import CallLog, FlopTally, LiveStorageTracker, notify_paths, observers_deferred
from ..errors import PlanError
from ..sizing import kept_fp32_module_names

if TYPE_CHECKING:  # imported where measured: torch.distributed is 150 modules `import placement` does not need
    from torch.distributed._tools.mem_tracker import MemTracker

# Fake tensors claim `meta`: model code written to be planned on meta already skips its value checks there
# (`if not x.is_meta: int(x.max())`), which fake tensors, having no values, could not run.
_FAKE_DEVICE = torch.device("meta")
# With `keep_values`, the device the fake tensors claim: that of the constants they carry (see estimate_call).
_VALUES_DEVICE = torch.device("cpu")
# The most elements a constant made by an op on constants may have: fake mode's own limit is 1 (scalars).
_VALUES_NUMEL_LIMIT = 1 << 20

_COMMON_CALLS = ("forward", "encode", "decode")


class ActivationEstimateError(PlanError, RuntimeError):
    """The module's call could not run on fake tensors (wrong example inputs, data-dependent code, ...): one line,
    the full error in `__cause__`; `for_component(name)` names the pipeline component, as planners raise it."""

    def __init__(self, message: str, *, call: str = "", cause: str = "", model_failure: bool = False,
                 reads_values: bool = False) -> None:
        super().__init__(message)
        self.call, self.cause = call, cause
        # The model's reason (`fallback.is_model_failure`), and whether it is that the call reads tensor values.
        self.model_failure, self.reads_values = model_failure, reads_values

    def for_component(self, name: str) -> "ActivationEstimateError":
        return ActivationEstimateError(
            f"Could not estimate the activations of component {name!r} ({self.call}): {self.cause}. To plan "
            f"anyway, leave {name!r} out of the estimate: plan without call= (weights only), or give its peak "
            f"yourself with placement.plan(activations={{{name!r}: <bytes>, ...}}).",
            call=self.call, cause=self.cause, model_failure=self.model_failure, reads_values=self.reads_values,
        )


@dataclass(frozen=True, kw_only=True)
class CallEstimate:
    """One call estimated: its activation peak, and what it returned, made of plain `meta` tensors."""

    peak_bytes: int
    output: Any  # the call's return value, every tensor a meta tensor laid out alike (`fake_tensors.to_meta`)
    # What the call computes and touches (`tracking.FlopTally`): for the plan's time model.
    flops: int = 0
    bytes_touched: int = 0
    # None: the peak is the estimate. Else why the call could not be estimated: `peak_bytes` is 0, activations not
    # counted (`fallback.weights_only_fallback`); `output` is None when even a run with guessed values failed.
    fallback: str | None = None


def estimate_call(
    module: nn.Module,
    args: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "forward",
    dtype: torch.dtype | None = None,
    keep_values: bool = False,
) -> CallEstimate:
    """`module.<method>(*args, **kwargs)` run on fake tensors under `torch.inference_mode()`: the peak bytes it
    adds on top of the weights, and its return value with every tensor a `meta` tensor laid out alike.

    `module` may be on `meta`, hold real weights, or carry accelerate hooks (bypassed, then restored); it is not
    modified. `args` is a tuple (or a lone tensor); only shapes and dtypes matter. `dtype`: the floating dtype the
    module runs in, cast as loading with `torch_dtype` would (`_keep_in_fp32_modules` kept).

    `keep_values`: real integer and boolean inputs keep their values as constants, for models that size tensors
    by them (Lumina 2: `mask.sum(1).tolist()`); ops on constants alone then run for real, on the CPU.

    Repeated calls are replayed and earlier estimates reused (`memo`; not with `keep_values`: the key holds shapes
    only). The module's `CallObserver`s are told the calls of the run that counts, once it has ended.
    """
    _check_call(module, method)
    estimate_started(f"{type(module).__name__}.{method}")
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    with accelerate_hooks_bypassed(module):
        key = None if keep_values else cache_key(module, method, _as_run((args, kwargs), dtype), dtype)
        answer = cached(module, key)
        if answer is None:
            try:
                answer = _run(module, method, args, kwargs, dtype, keep_values)
            except ActivationEstimateError as error:
                return _fallen_back(module, method, args, kwargs, dtype, keep_values, error)
            remember(module, key, answer)
            if key is not None:  # the caller gets its own copy: what it does with it cannot reach the cache
                answer = dataclasses.replace(answer, output=to_meta(answer.output))
    return CallEstimate(peak_bytes=answer.peak_bytes, output=answer.output, flops=answer.flops,
                        bytes_touched=answer.bytes_touched)


def estimate_activations(
    module: nn.Module,
    args: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "forward",
    dtype: torch.dtype | None = None,
) -> int:
    """`estimate_call(...).peak_bytes`: what the call adds on top of the weights."""
    return estimate_call(module, args, kwargs, method=method, dtype=dtype).peak_bytes


def _as_run(inputs: Any, dtype: torch.dtype | None) -> Any:
    """The inputs as the run sees them (`_FakeCopies.inputs`: on meta, floating ones cast to `dtype`), for the
    cache's key: a float32 and a bfloat16 latent are one estimate at bfloat16 (FLUX's first step and the others)."""
    converted: dict[int, torch.Tensor] = {}  # id(original) -> its stand-in, so one tensor given twice stays one

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in converted:
            meta = tensor.detach().to("meta")
            converted[id(tensor)] = meta.to(dtype) if dtype is not None and meta.is_floating_point() else meta
        return converted[id(tensor)]

    return tree_map_only(torch.Tensor, convert, inputs)


def _fallen_back(module: nn.Module, method: str, args: tuple, kwargs: dict, dtype: torch.dtype | None,
                 keep_values: bool, error: ActivationEstimateError) -> CallEstimate:
    """Within `weights_only_fallback`, a failure of the model's answered with a stated weights-only estimate
    (`fallback` module doc); anything else, or no collector, raises `error` as it is."""
    collector = current_fallbacks()
    if collector is None or not error.model_failure:
        raise error
    if error.reads_values and not keep_values and any(isinstance(leaf, torch.Tensor) and _has_values(leaf)
                                                              for leaf in tree_leaves((args, kwargs))):
        try:  # its real integer inputs' values may be what it reads (Lumina 2's mask lengths): a real estimate
            return estimate_call(module, args, kwargs, method=method, dtype=dtype, keep_values=True)
        except ActivationEstimateError:
            pass
    try:
        with observers_deferred(module):
            guessed = _run_once(module, method, args, kwargs, dtype, keep_values, with_memo=False, guessing=True)
    except ActivationEstimateError:
        guessed = None
    else:  # the order its submodules ran in (a plausible one: the guessed branch's), for the plan's unit order
        notify_paths(module, guessed.calls)
    if guessed is None and collector.outputs_needed:
        raise error
    collector.add(EstimateFallback(module=weakref.ref(module), call=error.call, reason=error.cause,
                                   output_known=guessed is not None, reads_values=error.reads_values))
    if guessed is None:
        return CallEstimate(peak_bytes=0, output=None, fallback=error.cause)
    return CallEstimate(peak_bytes=0, output=guessed.output, flops=guessed.flops,
                        bytes_touched=guessed.bytes_touched, fallback=error.cause)


def _run(module: nn.Module, method: str, args: tuple, kwargs: dict, dtype: torch.dtype | None,
         keep_values: bool = False) -> CachedCall:
    # The module's observers are told the calls of the run that counts, after it (`observers_deferred`).
    with observers_deferred(module):
        answer = _run_once(module, method, args, kwargs, dtype, keep_values, with_memo=True) \
            if memo_enabled() else None
        if answer is None:  # the memo off, or a replay that would not have been exact (`memo`): a full run
            answer = _run_once(module, method, args, kwargs, dtype, keep_values, with_memo=False)
    notify_paths(module, answer.calls)
    return answer


def _run_once(module: nn.Module, method: str, args: tuple, kwargs: dict, dtype: torch.dtype | None,
              keep_values: bool, *, with_memo: bool, guessing: bool = False) -> CachedCall | None:
    """The call on fake tensors; None when the block memo found a replay would not be exact. `guessing`: the
    values the call reads are guessed (`fallback.ValuesGuessed`), for its output's shapes only."""
    # Plain tensor attributes the module keeps outside its parameters and buffers (a 0-d scale, say) are
    # real; let the fake mode wrap them on the fly rather than refuse the call.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    copies = _FakeCopies(fake_mode, dtype, keep_values=keep_values)
    weights = copies.module_tensors(module)
    fake_args, fake_kwargs = copies.inputs((args, kwargs))

    tracker = LiveStorageTracker()
    tracker.exclude(weights.values())
    tracker.count(tree_leaves((fake_args, fake_kwargs)))
    log, tally = CallLog(), FlopTally()
    memo = BlockMemo(tracker, log, tally) if with_memo else None
    try:
        with collection_paused(), torch_silenced(), shape_only_stand_ins(module, values_kept=keep_values), \
                _constants_propagated(keep_values), module_state_kept(module), log.on(module), \
                memo.installed(module) if memo is not None else contextlib.nullcontext():
            with torch.inference_mode(), fake_mode, _reparametrize_module(module, weights):
                # The tally below the tracker: the tracker sees each op whole, as the tally's module doc says.
                with FusedAttentionAccounting(tally.attention), MetaConstants(), tally, tracker, \
                        ValuesGuessed() if guessing else contextlib.nullcontext():
                    # Looked up here: with the hooks bypassed, `forward` is the module's own again.
                    output = getattr(module, method)(*fake_args, **fake_kwargs)
    except Exception as error:  # re-raised with what the caller needs to fix it
        if memo is not None and memo.diverged:
            return None
        raise _failure(module, method, args, kwargs, error) from error
    if memo is not None and memo.diverged:  # raised inside the model's code, and caught there
        return None
    return CachedCall(peak_bytes=tracker.peak_bytes, output=to_meta(output), calls=log.paths(module),
                      flops=tally.flops, bytes_touched=tally.bytes_touched)


class _FakeCopies:
    """Fake stand-ins for real or meta tensors: same shape and dtype (or `dtype`), no storage allocated."""

    def __init__(self, fake_mode: FakeTensorMode, dtype: torch.dtype | None, *, keep_values: bool = False):
        self._fake_mode = fake_mode
        self._dtype = dtype
        self._keep_values = keep_values
        self._device = _VALUES_DEVICE if keep_values else _FAKE_DEVICE
        self._memo: dict[int, torch.Tensor] = {}  # id(original) -> fake, so tied weights stay tied

    def tensor(self, original: torch.Tensor, *, cast: bool) -> torch.Tensor:
        key = id(original)
        if key not in self._memo:
            meta = original.detach().to("meta")  # free: a meta tensor has no data to copy
            if cast and self._dtype is not None and meta.is_floating_point():
                meta = meta.to(self._dtype)
            if self._keep_values and _has_values(original):
                self._memo[key] = FakeTensor(self._fake_mode, meta, self._device, constant=original.detach().cpu())
            else:
                converter = self._fake_mode.fake_tensor_converter
                self._memo[key] = converter.from_meta_and_device(self._fake_mode, meta, self._device)
        return self._memo[key]

    def module_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by its full name (tied ones under each of their names)."""
        keep_fp32 = kept_fp32_module_names(module, self._dtype)
        named = list(module.named_parameters(remove_duplicate=False))
        named += list(module.named_buffers(remove_duplicate=False))
        return {
            name: self.tensor(value, cast=keep_fp32.isdisjoint(name.split(".")))
            for name, value in named
            if value is not None
        }

    def inputs(self, tree: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: self.tensor(t, cast=True), tree)


def _has_values(tensor: torch.Tensor) -> bool:
    """A real (not meta, not fake) integer or boolean tensor small enough to carry as a constant."""
    return not tensor.is_meta and not isinstance(tensor, FakeTensor) and not tensor.is_floating_point() \
        and not tensor.is_complex() and tensor.numel() <= _VALUES_NUMEL_LIMIT


@contextlib.contextmanager
def _constants_propagated(on: bool) -> Iterator[None]:
    """Within it, ops on constants give constants of up to `_VALUES_NUMEL_LIMIT` elements (not only scalars)."""
    if not on:
        yield
        return
    limit = fake_tensor_module.CONSTANT_NUMEL_LIMIT
    fake_tensor_module.CONSTANT_NUMEL_LIMIT = _VALUES_NUMEL_LIMIT
    try:
        yield
    finally:
        fake_tensor_module.CONSTANT_NUMEL_LIMIT = limit




def _defines(module: nn.Module, method: str) -> bool:
    # nn.Module itself has a `forward` that only raises; it does not count as defining one.
    attribute = getattr(type(module), method, None)
    return callable(getattr(module, method, None)) and attribute is not nn.Module.forward


def _check_call(module: nn.Module, method: str) -> None:
    if not isinstance(module, nn.Module):
        raise PlanError(
            f"An activation estimate needs an nn.Module, got {type(module).__name__}."
        )
    if not _defines(module, method):
        candidates = [name for name in _COMMON_CALLS if _defines(module, name)]
        raise PlanError(
            f"{type(module).__name__} has no method {method!r} to estimate; pass method= the method the "
            f"pipeline calls (this module has: {', '.join(candidates)})."
        )


def _failure(module: nn.Module, method: str, args: tuple, kwargs: dict, error: Exception) -> ActivationEstimateError:
    call = f"{type(module).__name__}.{method} on inputs {_describe(args)}{', ' + _describe(kwargs) if kwargs else ''}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(". ")
    return ActivationEstimateError(
        f"Could not estimate the activations of {call}: {cause}. Check that the example inputs match the model's "
        "config; code that needs tensor values (e.g. `if mask.any():`, `.item()`) cannot run without data and "
        "must branch on shapes instead.",
        call=call, cause=cause, model_failure=is_model_failure(error), reads_values=reads_values(error),
    )


def _describe(tree: Any) -> str:
    if isinstance(tree, torch.Tensor):
        return f"{str(tree.dtype).removeprefix('torch.')}{list(tree.shape)}"
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{key}={_describe(value)}" for key, value in tree.items()) + "}"
    if isinstance(tree, (tuple, list)):
        return "(" + ", ".join(_describe(item) for item in tree) + ")"
    return repr(tree)


# MemTracker's snapshot categories that are weights, not activations.
_WEIGHT_CATEGORIES = ("Parameter", "Buffer")


def measure_activations(
    module: nn.Module,
    args: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "forward",
) -> int:
    """Peak bytes, on top of the weights, of really running `module.<method>(*args, **kwargs)` under
    `torch.inference_mode()`: inputs, intermediates and output, as `estimate_activations` counts them."""
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    from torch.distributed._tools.mem_tracker import MemTracker  # lazily: see the TYPE_CHECKING import

    inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    tracker = MemTracker()
    tracker.track_external(module, *inputs)
    with torch.inference_mode(), tracker:
        getattr(module, method)(*args, **kwargs)
    return activation_peak(tracker)


def activation_peak(tracker: "MemTracker") -> int:
    """The peak bytes a finished MemTracker saw on its one device, parameters and buffers left out."""
    peaks = tracker.get_tracker_snapshot("peak")
    if not peaks:
        return 0
    if len(peaks) > 1:
        raise RuntimeError(
            f"measure_activations measures one device at a time; the call touched {sorted(map(str, peaks))}."
        )
    (snapshot,) = peaks.values()
    return sum(value for key, value in snapshot.items() if key != "Total" and key not in _WEIGHT_CATEGORIES)
