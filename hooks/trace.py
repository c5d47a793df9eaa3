"""A trace of what the runtime does per call: copies issued and done, blocks computing, per block and device.

    with hooks.trace_calls() as trace:
        pipe(...)
    trace.save("run.json")          # Chrome trace JSON (Perfetto); `Plan.timeline()` writes the predicted one

Bytes alone cannot show the order the plan promises (each streamed copy issued before the compute that hides it);
this can. On a GPU times are CUDA events on the stream that did the work; elsewhere the host clock. While no
trace is on, the cost is one `None` check per copy.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from placement.drawings import COMPUTE_END, COMPUTE_START, COPY_DONE, COPY_ISSUED, TraceEvent, chrome_trace
from placement.devices import Device, is_accelerator, torch_device


@dataclass(frozen=True, kw_only=True)
class BlockLabel:
    """A traced module: its component, its path there ("" for the component's own run), where it runs, and
    whether it streams (its group hook then marks when it starts computing)."""

    component: str
    path: str
    place: Device
    streamed: bool = False


_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, BlockLabel]" = weakref.WeakKeyDictionary()
_GROUPS: "weakref.WeakKeyDictionary[object, BlockLabel]" = weakref.WeakKeyDictionary()
_ACTIVE: "CallTrace | None" = None


def label_block(module: nn.Module, label: BlockLabel) -> None:
    _BLOCKS[module] = label


def label_group(group, label: BlockLabel) -> None:
    _GROUPS[group] = label


class CallTrace:
    def __init__(self) -> None:
        self._raw: list[tuple[TraceEvent, object]] = []  # (event, host seconds or a CUDA event)
        self._base_host = time.perf_counter()
        self._base_cuda: dict[torch.device, torch.cuda.Event] = {}
        self.events: list[TraceEvent] = []

    def record(self, kind: str, label: BlockLabel, *, nbytes: int = 0, device: torch.device | None = None,
               stream=None) -> None:
        event = TraceEvent(kind=kind, component=label.component, block=label.path, place=label.place,
                           nbytes=nbytes)
        self._raw.append((event, self._stamp(device, stream)))

    def _stamp(self, device: torch.device | None, stream):
        """Host seconds, or on CUDA a timing event on `stream` (the current one when None)."""
        if device is None or device.type != "cuda":
            return time.perf_counter()
        if device not in self._base_cuda:
            base = torch.cuda.Event(enable_timing=True)
            base.record(torch.cuda.current_stream(device))
            self._base_cuda[device] = base
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(stream if stream is not None else torch.cuda.current_stream(device))
        return device, mark

    def finish(self) -> None:
        if self._base_cuda:
            torch.cuda.synchronize()
        resolved = []
        for event, stamp in self._raw:
            if isinstance(stamp, tuple):
                device, mark = stamp
                micros = self._base_cuda[device].elapsed_time(mark) * 1000.0
            else:
                micros = (stamp - self._base_host) * 1e6
            resolved.append(replace(event, time_us=max(micros, 0.0)))
        self.events = resolved

    def to_chrome(self) -> dict:
        return chrome_trace(self.events)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_chrome(), file)


@contextmanager
def trace_calls() -> Iterator[CallTrace]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("trace_calls() is already on; traces do not nest.")
    trace = CallTrace()
    handles = [nn.modules.module.register_module_forward_pre_hook(_called),
               nn.modules.module.register_module_forward_hook(_returned, always_call=True)]
    _ACTIVE = trace
    try:
        yield trace
    finally:
        _ACTIVE = None
        for handle in handles:
            handle.remove()
        trace.finish()


def record_into(trace: "CallTrace | None") -> "CallTrace | None":
    """Make `trace` the one the runtime's copies and block marks go to (None: none), without the module-wide
    hooks of `trace_calls()`; returns the one before, to put back. A placed run's timing (`hooks.run_timing`)
    records its components' copies so."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, trace
    return previous


def active_trace() -> "CallTrace | None":
    return _ACTIVE


def _device_of(label: BlockLabel) -> torch.device:
    return torch_device(label.place) if is_accelerator(label.place) else torch.device("cpu")


def _called(module: nn.Module, args) -> None:
    if not getattr(_BLOCKS.get(module), "streamed", True):  # a streamed block's group hook says when it computes
        compute_started(module)


def _returned(module: nn.Module, args, output) -> None:
    _compute(COMPUTE_END, module)


def compute_started(module: nn.Module) -> None:
    _compute(COMPUTE_START, module)


def _compute(kind: str, module: nn.Module) -> None:
    label = _BLOCKS.get(module)
    if label is not None and _ACTIVE is not None:
        _ACTIVE.record(kind, label, device=_device_of(label))


def copy_issued(group, device: torch.device, stream=None) -> None:
    _copy(COPY_ISSUED, group, device, stream)


def copy_done(group, device: torch.device, stream=None) -> None:
    _copy(COPY_DONE, group, device, stream)


def _copy(kind: str, group, device: torch.device, stream) -> None:
    if _ACTIVE is not None:
        label = _GROUPS.get(group) or BlockLabel(component="", path=group.name, place=group.onload_place)
        _ACTIVE.record(kind, label, nbytes=group.num_bytes, device=device, stream=stream)


__all__ = ["BlockLabel", "CallTrace", "TraceEvent", "active_trace", "compute_started", "copy_done", "copy_issued",
           "label_block", "label_group", "record_into", "trace_calls"]
