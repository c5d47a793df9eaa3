"""LiveStorageTracker: the peak of live tensor-storage bytes while a call runs, weights left out.

Why not `torch.distributed._tools.mem_tracker.MemTracker`? It exists in this torch and gives the same peak
(the tests measure real runs with it, as an independent reference), but it installs global module hooks and
rescans every tracked module after every op: on a FLUX-size DiT at 1024x1024 it costs more than the fake
forward itself, which would miss the issue's 2 s target. This tracker keeps only what the estimate needs:
one running total, one peak.

How it counts: every tensor an op returns is looked at by its untyped storage (so views and in-place results
add nothing); a storage seen for the first time adds its bytes, and a weak reference on it takes them away
when the program drops the last tensor that uses it — the same moment a real allocator would free it.
Storages registered with `exclude` (the weights) are never counted, even when an op returns a view of one
(`weight.t()` inside `linear`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorageTracker(TorchDispatchMode):
    """A dispatch mode that records `live_bytes` and its maximum `peak_bytes`.

    Enter it *after* (inside) a `FakeTensorMode` so it sees each op once, as the caller issued it, rather
    than the fake mode's internal decompositions.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> weak reference whose callback releases the storage's bytes.
        self._counted: dict[int, weakref.ref] = {}
        # Storages that are never counted; strong references keep their ids from being reused.
        self._excluded: dict[int, torch.UntypedStorage] = {}

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count the storages of these tensors (the module's weights)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._excluded[id(storage)] = storage

    def count(self, tensors: Iterable[Any]) -> None:
        """Count the storages of these tensors as live now (the call's inputs); non-tensors are skipped."""
        for leaf in tensors:
            if isinstance(leaf, torch.Tensor):
                self._count_storage(leaf.untyped_storage())

    def counted_storages(self) -> frozenset[int]:
        """The keys (`storage_key`) of the storages counted and alive now."""
        return frozenset(self._counted)

    @contextlib.contextmanager
    def window(self) -> Iterator["Window"]:
        """Within it, the highest live bytes reached above those at entry are measured (`Window.transient_bytes`,
        set on exit); `peak_bytes` is the same as without the window. Windows nest."""
        saved, window = self.peak_bytes, Window(entry_bytes=self.live_bytes)
        self.peak_bytes = self.live_bytes
        try:
            yield window
        finally:
            window.transient_bytes = self.peak_bytes - window.entry_bytes
            self.peak_bytes = max(saved, self.peak_bytes)

    def _count_storage(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # = storage_key(tensor)
        if key in self._excluded or key in self._counted:
            return
        nbytes = storage.nbytes()
        self._counted[key] = weakref.ref(storage, partial(self._release, key, nbytes))
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int, nbytes: int, _dead_ref: weakref.ref) -> None:
        if self._counted.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.count(tree_leaves(result))
        return result


def storage_key(tensor: torch.Tensor) -> int:
    """How the tracker tells storages apart (views of one tensor share it)."""
    return id(tensor.untyped_storage())


@dataclass(kw_only=True)
class Window:
    """A stretch of a tracked run (`LiveStorageTracker.window`): live bytes at its start, the most above them."""

    entry_bytes: int
    transient_bytes: int = 0
