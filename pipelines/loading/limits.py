"""Limits checked before and while a module is built on meta from its config.json, and of a `call=` from its
numbers alone: an absurd config (`num_layers=1e12` loops for hours; `hidden_size=1e12` asks the allocator for a
petabyte under `init_empty_weights`) or call (a decode over millions of tiles) is refused at once, naming the
number and the limit. Only the absurd is refused here: a model that merely does not fit is the planner's to explain."""

from __future__ import annotations

import inspect
import math
import re
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import psutil
import torch

from placement.budgets import resolve_budgets
from placement.devices import device_label
from placement.errors import DoesNotFitError
from placement.sizes import format_bytes

from ..errors import FolderError


MAX_REPEATS = 10_000
ACCELERATOR_BOUND = 1024**4  # more memory than any accelerator has (the largest hold under 300 GB)
# A config field that counts repeated blocks: `num_layers`, `num_hidden_layers`, `layers_per_block`,
# `num_res_blocks`, `depth`, `n_routed_experts`, ... (plural words only: `block_out_channels` holds widths).
_REPEAT_FIELD = re.compile(r"(^|_)(layers|blocks|depths?|experts)(_|$)")
_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "arange")


@dataclass(frozen=True, kw_only=True)
class BuildLimit:
    """The bytes every budget of a load holds together (the most any component's weights can take), in words."""

    total: int
    described: str

    @classmethod
    def of(cls, max_memory: Mapping | None, offload_folder: str | Path | None, *, accelerators: int) -> "BuildLimit":
        """All budgets of `max_memory` together, the disk's free space included; without `max_memory`, a bound that
        touches no device: `accelerators` at `ACCELERATOR_BOUND` each, the machine's RAM, the disk."""
        if max_memory is None:
            parts = {f"{accelerators} accelerator(s) (1 TiB each at most)":
                     accelerators * ACCELERATOR_BOUND} if accelerators else {}
            parts["RAM"] = psutil.virtual_memory().total
            disk = None
        else:
            budgets = resolve_budgets(max_memory)
            parts = {device_label(device): limit for device, limit in budgets.limits.items()
                     if device != "disk" and limit is not None}
            disk = budgets.limit("disk")
        parts["disk" if disk is not None else "disk (free space)"] = (
            disk if disk is not None else _free_space(Path(offload_folder or ".")))
        total = sum(parts.values())
        described = " + ".join(f"{device} {format_bytes(size)}" for device, size in parts.items())
        return cls(total=total, described=f"{described} = {format_bytes(total)}")


def _free_space(folder: Path) -> int:
    existing = next((path for path in (folder.absolute(), *folder.absolute().parents) if path.exists()), Path("/"))
    return shutil.disk_usage(existing).free


def check_repeat_counts(name: str, path: Path, config: Mapping[str, Any]) -> None:
    """A field counting repeated blocks above `MAX_REPEATS` is a `FolderError` naming the field, its
    value and the limit (nested configs such as `text_config` included)."""
    for field, value in _numbers(config, repeats=True):
        if value > MAX_REPEATS:
            raise FolderError(
                f"Component {name!r}: {str(path)!r} sets {field}={value}, more blocks than any model has (the limit "
                f"is {MAX_REPEATS}; released models have at most a few hundred layers or experts of one kind), and "
                "building them would take hours. Fix the number in that config.json."
            )


def _numbers(config: Mapping[str, Any], prefix: str = "", *, repeats: bool = False) -> Iterator[tuple[str, int]]:
    """(dotted field, value) for each integer of a config, nested ones included (depth bounded by the JSON reader);
    `repeats`: of the fields counting repeated blocks only, each item of a list too."""
    for key, value in config.items():
        field = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _numbers(value, f"{field}.", repeats=repeats)
        elif not repeats or _REPEAT_FIELD.search(str(key)):
            for number in value if repeats and isinstance(value, list) else [value]:
                if isinstance(number, int) and not isinstance(number, bool):
                    yield field, number


def fewest_bits(dtype: torch.dtype | None, *, quantized: bool, layerwise: bool) -> int:
    """The fewest bits an element of this component can load in: 1 when quantized (1.58-bit formats exist), 8
    for fp8 layerwise casting, the `torch_dtype`'s when given, else 8 (fp8 is the smallest checkpoint dtype)."""
    if quantized:
        return 1
    if layerwise or dtype is None:
        return 8
    return dtype.itemsize * 8


@contextmanager
def bounded_construction(name: str, path: Path, config: Mapping[str, Any], limit: BuildLimit | None, *,
                         bits: int) -> Iterator[None]:
    """While the block runs, each tensor asked of torch's factories is counted before it is made: one needing more
    than `limit` at `bits` per element, or all together, is a `DoesNotFitError`."""
    if limit is None:
        yield
        return
    counter = _Counter(name=name, path=path, config=config, limit=limit, bits=bits, thread=threading.get_ident())
    originals = {factory: getattr(torch, factory) for factory in _FACTORIES}
    for factory, original in originals.items():
        setattr(torch, factory, counter.counting(factory, original))
    try:
        yield
    finally:
        for factory, original in originals.items():
            setattr(torch, factory, original)


@dataclass(kw_only=True)
class _Counter:
    name: str
    path: Path
    config: Mapping[str, Any]
    limit: BuildLimit
    bits: int
    thread: int
    elements: int = 0

    def counting(self, factory: str, original):
        def made(*args, **kwargs):
            if threading.get_ident() == self.thread:
                self.count(_SHAPES.get(factory, _shape)(args, kwargs))
            return original(*args, **kwargs)
        return made

    def count(self, shape: tuple[int, ...] | None) -> None:
        if shape is None:
            return
        elements = math.prod(shape)
        self.elements += elements
        if elements * self.bits // 8 > self.limit.total:
            fields = [f"{field}={value}" for field, value in _numbers(self.config) if value in shape and value > 1]
            self.refuse(f"a tensor of shape {list(shape)} ({elements:,} elements)", elements,
                        f"config numbers in that shape: {', '.join(fields)}" if fields else "")
        if self.elements * self.bits // 8 > self.limit.total:
            counts = [f"{field}={value}" for field, value in _numbers(self.config, repeats=True) if value > 1]
            self.refuse(f"{self.elements:,} elements of tensors so far", self.elements,
                        f"blocks repeated as {', '.join(counts)}" if counts else "")

    def refuse(self, what: str, elements: int, numbers: str) -> None:
        named = f" ({numbers})" if numbers else ""
        raise DoesNotFitError(
            f"Component {self.name!r}: {str(self.path)!r} builds {what}{named}, at least "
            f"{format_bytes(elements * self.bits // 8)} at {self.bits} bits per element, more than all budgets "
            f"together ({self.limit.described}). Nothing was allocated: fix the numbers in that config.json, or "
            "give budgets that can hold the model."
        )


def _shape(args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The shape a factory call asks for (`torch.empty(2, 3)`, `torch.zeros((2, 3))`, `size=`), or None."""
    return _as_shape(kwargs.get("size", args[0] if len(args) == 1 else args))


def _full_shape(args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, ...] | None:
    return _as_shape(kwargs.get("size", args[0] if args else ()))


def _as_shape(size: Any) -> tuple[int, ...] | None:
    if isinstance(size, int):
        size = (size,)
    try:
        return tuple(int(dimension) for dimension in size)
    except (TypeError, ValueError):
        return None


def _arange_shape(args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The length of `torch.arange(end)` / `arange(start, end, step)` (None when its bounds are tensors)."""
    if len(args) == 1 and "end" not in kwargs:
        start, end, step = 0, args[0], kwargs.get("step", 1)
    else:
        start = args[0] if args else kwargs.get("start", 0)
        end = args[1] if len(args) > 1 else kwargs.get("end")
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    try:
        return (max(0, math.ceil((float(end) - float(start)) / float(step))),)
    except (TypeError, ValueError, ZeroDivisionError, RuntimeError, NotImplementedError):
        return None


_SHAPES = {"full": _full_shape, "arange": _arange_shape}


_CHANNELS, _DECODE_BYTES, _TOKEN_BYTES = 3, 2, 8


def check_call_limits(call: Mapping[str, Any], max_memory: Mapping | None, *, pipe: Any = None) -> None:
    """A `DoesNotFitError` when a tensor the call must hold whole (its decoded output, its token ids) is larger than
    every single device's budget; only the keys `pipe` takes are weighed."""
    call = {key: value for key, value in call.items() if _takes(pipe, key)}
    budgets = resolve_budgets(max_memory)
    devices = {device: limit for device, limit in budgets.limits.items() if device != "disk" and limit is not None}
    if not devices:
        return
    largest = max(devices, key=devices.get)
    copies = _number(call, "batch_size") * _number(call, "num_images_per_prompt")
    needs = []
    if _given(call, "height") and _given(call, "width"):
        pixels = call["height"] * call["width"] * _number(call, "num_frames") * copies
        numbers = ", ".join(f"{key}={call[key]}" for key in ("height", "width", "num_frames", "batch_size",
                                                              "num_images_per_prompt") if _given(call, key))
        needs.append((pixels * _CHANNELS * _DECODE_BYTES,
                      f"its decoded output ({numbers}: {pixels:,} pixels x {_CHANNELS} channels x {_DECODE_BYTES} "
                      "bytes at the fewest)"))
    if _given(call, "max_sequence_length"):
        tokens = call["max_sequence_length"] * copies
        needs.append((tokens * _TOKEN_BYTES, f"its token ids (max_sequence_length={call['max_sequence_length']}: "
                                             f"{tokens:,} tokens x {_TOKEN_BYTES} bytes)"))
    for size, what in needs:
        if size > devices[largest]:
            raise DoesNotFitError(
                f"call={dict(call)!r} needs {format_bytes(size)} for {what}, held whole on one device, more than "
                f"the largest budget ({device_label(largest)}: {format_bytes(devices[largest])}). Nothing was "
                "estimated: ask for a smaller call, or give a device that can hold it."
            )


def _takes(pipe: Any, key: str) -> bool:
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        return True  # a diffusers family: its call keys are checked against its table when estimated
    parameters = inspect.signature(describe).parameters
    return key in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _given(call: Mapping[str, Any], key: str) -> bool:
    value = call.get(key)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(call: Mapping[str, Any], key: str) -> int:
    return call[key] if _given(call, key) else 1
