"""The first calls of a placed pipeline, timed per component: each run's seconds on the device it runs on (CUDA
events on its current stream on a GPU, the clock elsewhere) and the host -> device copies the runtime makes for
it (the call trace's copy marks, `hooks.trace`), so that `placement.plan_check` can hold the run to its plan.

    timing = RunTiming.attach(modules, places, runs_per_call={"transformer": 28})
    pipe(...); pipe(...)            # the first TIMED_CALLS calls are timed, then the hooks go
    timing.calls()                  # {component: [MeasuredCall per call]}

Each component gets an outermost forward pre-hook and hook (and its encode/decode, which diffusers pipelines call
directly) for its first `calls x runs_per_call` runs; while one of its runs is going, its copies are recorded
(unless the user's own `trace_calls()` is on: then only the run's seconds).
"""

from __future__ import annotations

import functools
import weakref
from typing import Mapping, Optional

import torch
from torch import nn

from placement.devices import Device, is_accelerator, torch_device
from placement.drawings import COMPUTE_END, COMPUTE_START, COPY_DONE, COPY_ISSUED
from placement.plan_check import MeasuredCall

from . import trace
from .input_moving import ENTRY_METHODS

TIMED_CALLS = 2  # the first pays for warm-up; the second is the steady state the plan predicts
_TIMINGS: "weakref.WeakKeyDictionary[nn.Module, RunTiming]" = weakref.WeakKeyDictionary()


class RunTiming:
    def __init__(self, places: Mapping[str, Device], runs_per_call: Mapping[str, int], calls: int) -> None:
        self.trace = trace.CallTrace()
        self.places = dict(places)
        self.runs_per_call = {name: max(1, runs_per_call.get(name, 1)) for name in places}
        self.quota = {name: calls * self.runs_per_call[name] for name in places}
        self.done = {name: 0 for name in places}
        self._depth = {name: 0 for name in places}
        self._previous: dict[str, "trace.CallTrace | None"] = {}
        self._handles: list = []
        self._wrapped: list[tuple[nn.Module, str, object]] = []
        self._resolved = False

    @classmethod
    def attach(cls, modules: Mapping[str, nn.Module], places: Mapping[str, Device],
               runs_per_call: Mapping[str, int], *, calls: int = TIMED_CALLS) -> "RunTiming":
        """Time `modules` (name -> module) running on `places` (name -> plan device)."""
        timing = cls({name: places[name] for name in modules}, runs_per_call, calls)
        for name, module in modules.items():
            timing._hook(name, module)
            _TIMINGS[module] = timing
        return timing

    def _hook(self, name: str, module: nn.Module) -> None:
        start, end = functools.partial(self._start, name), functools.partial(self._end, name)
        self._handles += [module.register_forward_pre_hook(lambda *_: start(), prepend=True),
                          module.register_forward_hook(lambda *_: end(), always_call=True)]
        for method_name in ENTRY_METHODS:
            method = getattr(module, method_name, None)
            if callable(method):
                wrapper = _timed(method, start, end)
                self._wrapped.append((module, method_name, module.__dict__.get(method_name)))
                setattr(module, method_name, wrapper)

    @property
    def finished(self) -> bool:
        return all(self.done[name] >= self.quota[name] for name in self.done)

    def _label(self, name: str) -> trace.BlockLabel:
        return trace.BlockLabel(component=name, path="", place=self.places[name])

    def _device(self, name: str) -> Optional[torch.device]:
        place = self.places[name]
        return torch_device(place) if is_accelerator(place) else None

    def _start(self, name: str) -> None:
        self._depth[name] += 1
        if self._depth[name] > 1 or self.done[name] >= self.quota[name]:
            return
        self.trace.record(COMPUTE_START, self._label(name), device=self._device(name))
        if trace.active_trace() is None:
            self._previous[name] = trace.record_into(self.trace)

    def _end(self, name: str) -> None:
        self._depth[name] = max(0, self._depth[name] - 1)
        if self._depth[name] or self.done[name] >= self.quota[name]:
            return
        self.trace.record(COMPUTE_END, self._label(name), device=self._device(name))
        if name in self._previous:
            trace.record_into(self._previous.pop(name))
        self.done[name] += 1
        if self.finished:
            self.remove()

    def remove(self) -> None:
        """Take the hooks off (the figures stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module, method_name, before in self._wrapped:
            current = module.__dict__.get(method_name)
            if getattr(current, "__wrapped_by_run_timing__", False):
                if before is None:
                    delattr(module, method_name)
                else:
                    setattr(module, method_name, before)
            _TIMINGS.pop(module, None)
        self._wrapped = []

    def calls(self) -> dict[str, list[MeasuredCall]]:
        """Per component, one `MeasuredCall` per call timed so far (its runs split by `runs_per_call`)."""
        if not self._resolved:
            self.trace.finish()
            self._resolved = self.finished
        events = self.trace.events
        found = {}
        for name in self.places:
            spans = _spans([e for e in events if e.component == name and not e.block],
                           COMPUTE_START, COMPUTE_END)
            copies = _spans([e for e in events if e.component == name and e.block], COPY_ISSUED, COPY_DONE)
            found[name] = self._per_call(name, spans, copies)
        return found

    def _per_call(self, name: str, spans: list, copies: list) -> list[MeasuredCall]:
        runs = self.runs_per_call[name]
        place = self.places[name]
        blocking = getattr(self._device(name), "type", "cpu") != "cuda"  # CUDA copies go on a side stream
        calls = []
        for index in range(len(spans) // runs):
            mine = spans[index * runs:(index + 1) * runs]
            # Its copies: issued after the previous call's last run ended (a per-call load may be sent ahead,
            # while the component before it runs) and before this call's last run ended.
            begin = -float("inf") if index == 0 else spans[index * runs - 1][1]
            moved = [(start, stop, nbytes) for start, stop, nbytes in copies if begin < start <= mine[-1][1]]
            calls.append(MeasuredCall(
                component=name, place=place, runs=runs, call_index=index, blocking=blocking,
                seconds=sum(stop - start for start, stop, _ in mine) / 1e6,
                copy_seconds=sum(stop - start for start, stop, _ in moved) / 1e6,
                copy_bytes=sum(nbytes for _, _, nbytes in moved)))
        return calls


def _spans(events: list, opening: str, closing: str) -> list[tuple[float, float, int]]:
    """(start us, end us, bytes) of each opening event and the next closing one of the same block, in order."""
    open_at: dict[str, list] = {}
    spans = []
    for event in events:
        if event.kind == opening:
            open_at.setdefault(event.block, []).append(event)
        elif event.kind == closing and open_at.get(event.block):
            start = open_at[event.block].pop(0)
            spans.append((start.time_us, event.time_us, start.nbytes))
    return sorted(spans)


def _timed(method, start, end):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start()
        try:
            return method(*args, **kwargs)
        finally:
            end()

    wrapper.__wrapped_by_run_timing__ = True
    return wrapper


def remove_run_timing(module: nn.Module) -> None:
    """Take off the timing of the run `module` is part of (`undispatch` does, with every other hook)."""
    timing = _TIMINGS.get(module)
    if timing is not None:
        timing.remove()


__all__ = ["RunTiming", "TIMED_CALLS", "remove_run_timing"]
