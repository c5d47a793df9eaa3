"""What an estimate watches while a call runs on fake tensors: the live storage bytes and their peak
(`LiveStorageTracker`), which modules are called (`CallObserver`, `CallLog`), and the FLOPs and bytes touched
(`FlopTally`).

Not torch's MemTracker or FlopCounterMode: both install global module hooks (costly on a FLUX-size DiT, and the
block memo must see no foreign hooks). The tracker counts each storage once, from the first op returning it until
a weak reference sees it die, weights excluded. An estimate skips calls (`memo`), so modules under a hook that
reads inputs or outputs are never skipped; `CallObserver`s only need to know a module ran and are told of
skipped calls in order. `FlopTally` applies torch's `flop_registry` formulas as FlopCounterMode does (equal to
the FLOP, tests hold it), with attention counted as the fused kernels compute it; bytes touched are each
computing op's inputs and outputs, a memory-traffic upper bound.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


class LiveStorageTracker(TorchDispatchMode):
    """A dispatch mode that records `live_bytes` and its maximum `peak_bytes`.

    Enter it *after* (inside) a `FakeTensorMode` so it sees each op once, as the caller issued it, rather
    than the fake mode's internal decompositions.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        # storage key -> weak reference whose callback releases the storage's bytes.
        self._counted: dict[int, weakref.ref] = {}
        # Storages that are never counted; strong references keep their ids from being reused.
        self._excluded: dict[int, torch.UntypedStorage] = {}

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count the storages of these tensors (the module's weights)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._excluded[_key(storage)] = storage

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
        key = _key(storage)
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
    return _key(tensor.untyped_storage())


# Not id(storage): CPython gives a storage allocated after one is freed the freed one's address, so a cache entry
# replaced during a call and its replacement would look like one storage that never died, and whether the memo
# could describe the call would depend on the allocator's state (what ran before in the process).
_keys: "weakref.WeakKeyDictionary[torch.UntypedStorage, int]" = weakref.WeakKeyDictionary()
_next_key = itertools.count()


def _key(storage: torch.UntypedStorage) -> int:
    key = _keys.get(storage)
    if key is None:
        key = _keys[storage] = next(_next_key)
    return key


@dataclass(kw_only=True)
class Window:
    """A stretch of a tracked run (`LiveStorageTracker.window`): live bytes at its start, the most above them."""

    entry_bytes: int
    transient_bytes: int = 0


class CallObserver:
    """A forward pre-hook (`module.register_forward_pre_hook(observer)`) that only notes which module ran."""

    def __call__(self, module: nn.Module, args) -> None:
        self.called(module)

    def called(self, module: nn.Module) -> None:
        raise NotImplementedError


def notify(module: nn.Module) -> None:
    """Tell `module`'s observers it was called (a call that was skipped: replayed or answered from the cache)."""
    for hook in list(module._forward_pre_hooks.values()):
        if isinstance(hook, CallObserver):
            hook.called(module)


def only_observed(modules: Iterable[nn.Module]) -> bool:
    """Whether a call of these modules may be skipped: no hook that sees inputs or outputs (theirs or global),
    and no `forward` replaced by someone else's wrapper (a diffusers hook, a patch) that might keep state."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    for module in modules:
        if module._forward_hooks or not all(isinstance(hook, CallObserver)
                                            for hook in module._forward_pre_hooks.values()):
            return False
        if not _own_forward(module):
            return False
    return True


def _own_forward(module: nn.Module) -> bool:
    # An instance `forward` is fine when it is the class's own bound to the module (what bypassing accelerate's
    # hooks puts back); anything else wraps the call in code we cannot replay.
    forward = module.__dict__.get("forward")
    return forward is None or (inspect.ismethod(forward) and forward.__self__ is module
                               and forward.__func__ is getattr(type(module), "forward", None))


@contextlib.contextmanager
def observers_deferred(root: nn.Module) -> Iterator[None]:
    """Within it, the `CallObserver`s on `root`'s submodules are set aside (other hooks stay, in their order); the
    caller tells them the calls afterwards (`notify_paths`). An estimate that abandons a run for another
    (`memo`'s `ReplayDiverged`) thus reports one run's calls, as a cache hit does."""
    saved = []
    for module in root.modules():
        hooks = module._forward_pre_hooks
        if any(isinstance(hook, CallObserver) for hook in hooks.values()):
            saved.append((module, dict(hooks)))
            for key in [key for key, hook in hooks.items() if isinstance(hook, CallObserver)]:
                del hooks[key]
    try:
        yield
    finally:
        for module, hooks in saved:
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks.update(hooks)


class CallLog(CallObserver):
    """The modules called, in order, every call (replayed ones too: `notify` reaches this observer as well)."""

    def __init__(self) -> None:
        self.calls: list[nn.Module] = []

    def called(self, module: nn.Module) -> None:
        self.calls.append(module)

    @contextlib.contextmanager
    def on(self, root: nn.Module) -> Iterator["CallLog"]:
        handles = [sub.register_forward_pre_hook(self) for sub in root.modules()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def paths(self, root: nn.Module, start: int = 0, end: int | None = None) -> tuple[str, ...]:
        """The calls from `start` to `end` as paths under `root` (a module outside it is left out)."""
        names = {id(sub): path for path, sub in root.named_modules()}
        return tuple(names[id(sub)] for sub in self.calls[start:end] if id(sub) in names)


def notify_paths(root: nn.Module, paths: Iterable[str]) -> None:
    """`notify` each of `root`'s submodules named by `paths`, in that order (a skipped call's recorded calls)."""
    modules = dict(root.named_modules())
    for path in paths:
        notify(modules[path])


_SHAPE_QUERIES = {getattr(torch.ops.aten, name).default for name in (
    "sym_size", "sym_stride", "size", "stride", "numel", "dim", "is_contiguous", "sym_numel", "sym_storage_offset",
    "storage_offset")} | {torch.ops.prim.layout.default, torch.ops.prim.device.default}


class FlopTally(TorchDispatchMode):
    """A dispatch mode adding up `tracking` and `bytes_touched` of the ops it sees (module doc).

    Enter it inside the `FakeTensorMode` and outside (before) the `LiveStorageTracker`: the tracker then sees each
    op whole, as without the tally, and the decompositions the tally makes reach only the fake mode below it."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes_touched = 0
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within it, ops count nothing (a replayed block's stand-in allocations: its work is `add`ed instead)."""
        saved, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = saved

    def add(self, flops: int, bytes_touched: int = 0) -> None:
        """Count work done outside dispatch (a replayed block, a fused attention call)."""
        self.flops += flops
        self.bytes_touched += bytes_touched

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        """A fused attention call: 2 x (Q K^T) + 2 x (P V) multiply-adds; it reads Q, K, V and writes the output."""
        rows = math.prod(output.shape[:-1])  # batch x heads x query length
        keys = key.shape[-2]
        self.add(2 * rows * keys * query.shape[-1] + 2 * rows * keys * value.shape[-1],
                 sum(_nbytes(t) for t in (query, key, value, output)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_QUERIES or self._paused:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet not in flop_registry:
            with self:  # as FlopCounterMode does: the parts come back through this mode
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        if not func.is_view:  # a reshape moves no data
            self.bytes_touched += _traffic(args, kwargs, out)
        return out


def _traffic(args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor inputs, and its outputs but those it wrote in place."""
    inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    storages = {id(t.untyped_storage()) for t in inputs}
    written = [leaf for leaf in tree_leaves(out)
               if isinstance(leaf, torch.Tensor) and id(leaf.untyped_storage()) not in storages]
    return sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in written)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
