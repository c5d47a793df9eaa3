"""The order a module's split units run in, traced from one forward on fake tensors, so splits are cut in it:
a split crosses devices once per boundary only if its units are in run order. The pipeline planner records it
during its activation estimate, so a call-aware plan costs no extra forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .activations.estimate import estimate_activations
from .activations.tracking import CallObserver
from .device_maps import owning_key
from .sizing import SplitUnit


@contextlib.contextmanager
def record_module_order(module: nn.Module, *, every_call: bool = False) -> Iterator[list[str]]:
    """Within the block, the yielded list gets each submodule's path ("" for `module`) at its first call (every
    call with `every_call`); `CallObserver`s, so calls an estimate replays or answers from its cache count too."""
    order: list[str] = []
    seen: set[str] = set()
    handles = [sub.register_forward_pre_hook(_PathRecorder(path, order, seen, every_call))
               for path, sub in module.named_modules()]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


class _PathRecorder(CallObserver):
    """Appends its module's path to `order` at its first call (every call with `every_call`)."""

    def __init__(self, path: str, order: list[str], seen: set[str], every_call: bool) -> None:
        self._path, self._order, self._seen, self._every_call = path, order, seen, every_call

    def called(self, module: nn.Module) -> None:
        if self._every_call or self._path not in self._seen:
            self._seen.add(self._path)
            self._order.append(self._path)


def trace_module_order(module: nn.Module, args: Any, kwargs: Mapping[str, Any] | None = None, *,
                       method: str = "forward", dtype: torch.dtype | None = None) -> list[str]:
    """Submodule paths in first-call order for `module.<method>(*args, **kwargs)`, run on fake tensors."""
    with record_module_order(module) as order:
        estimate_activations(module, args, kwargs, method=method, dtype=dtype)
    return order


def order_units(units: Sequence[SplitUnit], module_order: Sequence[str]) -> tuple[SplitUnit, ...]:
    """`units` (in structural order) sorted by the first call of their module in `module_order`; a unit the
    trace never saw (a tensor held by a parent module, a submodule this call skips) stays right after the
    unit it follows structurally."""
    rank = {path: index for index, path in enumerate(module_order)}
    ordered = sorted((unit for unit in units if unit.path in rank), key=lambda unit: rank[unit.path])
    if not ordered:
        return tuple(units)
    for index, unit in enumerate(units):
        if unit.path in rank:
            continue
        before = next((units[j] for j in range(index - 1, -1, -1) if units[j] in ordered), None)
        ordered.insert(ordered.index(before) + 1 if before is not None else 0, unit)
    return tuple(ordered)


def device_crossings(calls: Sequence[str], device_map: Mapping[str, Any]) -> int:
    """How many times a forward that calls submodules in the sequence `calls` (`record_module_order(...,
    every_call=True)`) moves to another device under `device_map` (each path's device is its longest mapped
    prefix; unmapped paths, such as the containers of a split, are skipped)."""
    crossings, current = 0, None
    for path in calls:
        key = owning_key(path, device_map)
        if key is None:
            continue
        if current is not None and device_map[key] != current:
            crossings += 1
        current = device_map[key]
    return crossings
