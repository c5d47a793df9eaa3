"""Estimates not run twice: a repeated block called with inputs seen before is replayed (`BlockMemo`, within one
estimate), and a call estimated before on an unchanged module is answered from memory (the cache, across plans).
Both key on `calls.call_signature` and `calls.module_state`, and tell `CallObserver`s of the calls they skip.

A FLUX DiT runs 57 blocks of two kinds, a causal video VAE its decoder once per latent frame: each call on fake
tensors costs as much as the first and tells nothing new. Candidates are the repeated members of a ModuleList or
Sequential and the estimated module's children. A replay allocates and frees the first run's transient at once
(every tracker sees its peak), rebuilds its outputs and list/dict writes (`calls.Effects`), counts its FLOPs
again and reports its submodules' calls in order. A run is recorded only when what it did can be described;
blocks with foreign hooks are never replayed; a replay that diverges reruns the estimate without the memo. A
decoder layer's transformers KV cache stands for the one layer of it the block writes (`own_cache_slots`).

The cache key holds everything an estimate depends on (module state, method, inputs, dtype, torch's default
dtype, whether the memo is on), so a changed module never gets a stale answer and two modules of equal state
(Wan 2.2's two experts) share one. Entries are held per module, weakly, at most `_PER_MODULE` of them; a call
whose inputs hold other than tensors and plain values, or whose modules carry foreign hooks, is never cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import weakref
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn

from .calls import BLOCK_INDEX_ATTRIBUTES, Effects, Entry, ReplayDiverged, call_signature, module_state
from .fake_tensors import to_meta
from .progress import block_called
from .tracking import CallLog, FlopTally, LiveStorageTracker, notify_paths, only_observed

MEMO_ENV = "PLACEMENT_BLOCK_MEMO"
# The memo's wrapper is the block's `forward` while it runs: not part of what makes two blocks identical.
_IDENTITY_IGNORES = BLOCK_INDEX_ATTRIBUTES | {"forward"}
_GIVE_UP = 2


def memo_enabled() -> bool:
    return os.environ.get(MEMO_ENV, "1") != "0"


class BlockMemo:
    """The records of one estimate: {(block identity, input signature): how to replay that call}."""

    def __init__(self, tracker: LiveStorageTracker, log: CallLog, tally: FlopTally | None = None) -> None:
        self._tracker, self._log, self._tally = tracker, log, tally or FlopTally()
        self._records: dict[Hashable, _Record] = {}
        # Candidates whose first runs could not be described (blocks stashing tensors on themselves), by group:
        # after `_GIVE_UP` of those, the group runs without the memo's bookkeeping.
        self._failures: dict[Hashable, int] = {}
        self.diverged = False  # a replay did otherwise than its run: the estimate is to run again without the memo
        self.replays = 0  # calls answered by a replay
        self._root: nn.Module | None = None

    @contextlib.contextmanager
    def installed(self, root: nn.Module) -> Iterator[None]:
        """Within it, `root`'s candidate blocks go through the memo (their `forward` patched, then restored)."""
        patched = []
        self._root, token = root, _active.set(self)  # for `same_work_by_layout` functions the call runs
        try:
            # Decided before any is patched: a candidate holding others would see their wrappers as foreign.
            chosen = [(group, block) for group, blocks in candidates(root).items() for block in blocks
                      if only_observed(block.modules())]
            for group, block in chosen:
                patched.append((block, block.__dict__.get("forward")))
                block.forward = functools.partial(self._call, group, block, block.forward)
            yield
        finally:
            _active.reset(token)
            for block, own in reversed(patched):
                if own is None:
                    del block.forward
                else:
                    block.forward = own

    def _call(self, group: Hashable, block: nn.Module, forward: Callable, *args, **kwargs) -> Any:
        inputs, others = own_cache_slots(block, args, kwargs)
        return self._memoized(group, block, lambda: module_state(block, ignore=_IDENTITY_IGNORES),
                              functools.partial(forward, *args, **kwargs), inputs, untouched=others)

    def call_function(self, function: Callable, args: tuple, kwargs: dict, position: str | None = None) -> Any:
        """`function(*args, **kwargs)` through the memo (`same_work_by_layout`): the callables among its arguments
        are part of the key by identity, the keyword `position` not at all, the rest as a block's inputs are."""
        callables = tuple(_identity(value) for value in (*args, *kwargs.values()) if _is_callable(value))
        inputs = (tuple(map(_stand_in, args)),
                  {name: _stand_in(value) for name, value in kwargs.items() if name != position})
        return self._memoized(("function", function), self._root, lambda: (function, callables),
                              functools.partial(function, *args, **kwargs), inputs)

    def _memoized(self, group: Hashable, owner: nn.Module, identity_of: Callable[[], Hashable],
                  run: Callable[[], Any], inputs: tuple[tuple, dict],
                  untouched: Callable[[], Any] = tuple) -> Any:
        """`run()`, recorded or replayed by (`identity_of()`, the signature of `inputs`); `owner`: the module
        whose submodules' calls a replay reports; `untouched()`: what the run must leave as it was to be recorded
        (the KV cache's other layers, `own_cache_slots`)."""
        block_called()
        off = self.diverged or self._failures.get(group, 0) >= _GIVE_UP
        signature = None if off else call_signature(inputs, offsets=False)
        if signature is None:
            return run()
        entry = Entry.of(inputs)
        identity = identity_of()
        key = (identity, signature, entry.layout)
        record = self._records.get(key)
        if record is not None:
            self._tally.add(record.flops, record.bytes_touched)  # the same work as its first run
            self.replays += 1
            try:
                with self._tally.paused():  # its stand-in tensors are no work
                    return record.replay(owner, inputs, self._tracker)
            except ReplayDiverged:
                self.diverged = True
                raise
        before, live, start = self._tracker.counted_storages(), self._tracker.live_bytes, len(self._log.calls)
        flops, touched = self._tally.flops, self._tally.bytes_touched
        kept = untouched()
        with self._tracker.window() as window:
            output = run()
        effects = None
        if identity_of() == identity and untouched() == kept:
            effects = Effects.of(output, inputs, entry, before, self._tracker.counted_storages(),
                                 grown=self._tracker.live_bytes - live)
        if effects is None:
            self._failures[group] = self._failures.get(group, 0) + 1
        else:
            self._records[key] = _Record(
                transient_bytes=window.transient_bytes, effects=effects, flops=self._tally.flops - flops,
                bytes_touched=self._tally.bytes_touched - touched,
                children=self._log.paths(owner, start, len(self._log.calls)))
        return output


def own_cache_slots(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple[tuple, dict], Callable[[], Any]]:
    """A block's inputs as the memo describes them, and what the block must leave untouched. A transformers KV
    cache (an object holding `layers`, one per decoder layer: `DynamicCache`) is no input a signature can
    describe; but a decoder layer reads and writes only its own layer of it, the one its `layer_idx` names (the
    only thing the index is for: `calls.BLOCK_INDEX_ATTRIBUTES`). So the cache stands for that layer's attributes,
    a dict (`vars`) the replay rewrites as it rewrites a list or dict input (`calls.Effects`): Qwen2.5-VL's 28
    layers, each filling its empty layer of the cache, are run once and replayed 27 times. `untouched()`: the
    identities of everything else of each cache (its own attributes, its other layers'), which a run must leave
    as they were to be recorded."""
    caches = [value for value in (*args, *kwargs.values()) if _layered_cache(value)]
    if not caches:
        return (args, kwargs), tuple
    indexes = {getattr(module, "layer_idx", None) for module in block.modules()} - {None}
    index = next(iter(indexes)) if len(indexes) == 1 else None
    if not isinstance(index, int) or not all(0 <= index < len(cache.layers) for cache in caches):
        return (args, kwargs), tuple  # no single layer of the cache is the block's own: described as it is

    def slot(value: Any) -> Any:
        return vars(value.layers[index]) if any(value is cache for cache in caches) else value

    def others() -> _SameObjects:  # each cache's attributes, its layers (none added), the other layers' attributes
        return _SameObjects([pair for cache in caches for attributes in
                             (vars(cache), dict(enumerate(cache.layers)),
                              *(vars(layer) for i, layer in enumerate(cache.layers) if i != index))
                             for pair in attributes.items()])

    return (tuple(map(slot, args)), {name: slot(value) for name, value in kwargs.items()}), others


def _layered_cache(value: Any) -> bool:
    layers = getattr(value, "layers", None)
    return not isinstance(value, (nn.Module, torch.Tensor)) and type(layers) is list \
        and all(isinstance(getattr(layer, "__dict__", None), dict) for layer in layers)


class _SameObjects:
    """Attributes by identity: equal when the names are and each value is the same object (a tensor replaced is
    a change; compared by `is`, never by value). The snapshot holds its objects, so no id is reused meanwhile."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameObjects) and len(self.pairs) == len(other.pairs) and all(
            name == other_name and value is other_value
            for (name, value), (other_name, other_value) in zip(self.pairs, other.pairs))

    __hash__ = None  # compared, never a key


_CALLABLE = "<callable, keyed by identity>"  # what a callable argument is in a function's signature


def _is_callable(value: Any) -> bool:
    return callable(value) and not isinstance(value, (torch.Tensor, type))


def _stand_in(value: Any) -> Any:
    return _CALLABLE if _is_callable(value) else value


def _identity(function: Callable) -> tuple:
    """A callable argument by identity: its function and the object it is bound to (alive while the call runs)."""
    return getattr(function, "__func__", function), id(getattr(function, "__self__", None))


_active: ContextVar["BlockMemo | None"] = ContextVar("placement_block_memo", default=None)


def same_work_by_layout(function: Callable | None = None, *, position: str | None = None) -> Callable:
    """Marks a function whose calls do the same work (allocations, FLOPs) whenever its tensor arguments have the
    same shapes, strides and dtypes and its other arguments are equal (callables: the same ones), wherever the
    tensors start in their storages and whatever its keyword `position` says (where it reads and writes, not how
    much): a loop body such as one tile of a tiled decode. Within an estimate (the block memo on), such calls are
    run once and replayed (`BlockMemo`); elsewhere it is the plain function."""
    if function is None:
        return functools.partial(same_work_by_layout, position=position)

    @functools.wraps(function)
    def memoized(*args, **kwargs):
        memo = _active.get()
        if memo is None:
            return function(*args, **kwargs)
        return memo.call_function(function, args, kwargs, position)

    return memoized


def candidates(root: nn.Module) -> dict[Hashable, list[nn.Module]]:
    """The memo's candidates by group (module doc): `repeated_blocks`, then each child of `root` that has
    submodules and is not one already, in a group of its own."""
    groups = repeated_blocks(root)
    seen = {id(block) for blocks in groups.values() for block in blocks}
    for name, child in root.named_children():
        if id(child) not in seen and next(child.children(), None) is not None \
                and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # containers are never called
            groups[("child", name)] = [child]
    return groups


def repeated_blocks(root: nn.Module) -> dict[Hashable, list[nn.Module]]:
    """Members of `root`'s ModuleLists and Sequentials that have submodules and share class and parameter shapes
    with another such member, by (class, shapes) (the memo's candidates; whether two are identical is decided
    when called)."""
    groups: dict[Hashable, dict[int, nn.Module]] = {}
    for container in root.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child in container.children():
            if next(child.children(), None) is None:
                continue  # a leaf is one op: nothing to save
            shapes = tuple((name, tuple(tensor.shape)) for name, tensor in child.named_parameters())
            groups.setdefault((type(child), shapes), {})[id(child)] = child
    return {group: list(members.values()) for group, members in groups.items() if len(members) > 1}


@dataclass(frozen=True, kw_only=True)
class _Record:
    transient_bytes: int
    effects: Effects
    children: tuple[str, ...]  # the block's submodules called, in order, by path under the block
    flops: int = 0  # what its first run computed and touched, counted again at each replay
    bytes_touched: int = 0

    def replay(self, block: nn.Module, inputs: tuple, tracker: LiveStorageTracker) -> Any:
        transient = torch.empty(self.transient_bytes, dtype=torch.uint8, device="meta")
        del transient  # the first run's peak above the live bytes at entry, reached for an instant
        notify_paths(block, self.children)
        return self.effects.apply(inputs, tracker)


CACHE_ENV = "PLACEMENT_ESTIMATE_CACHE"
_PER_MODULE = 64  # distinct calls remembered per module (the oldest goes first)


@dataclass(frozen=True, kw_only=True)
class CachedCall:
    peak_bytes: int
    output: Any  # meta tensors (`to_meta`), copied again for each answer so no caller sees another's changes
    calls: tuple[str, ...]  # the module's submodules called, in order, by path (for the observers)
    flops: int = 0  # what the call computes and touches (`tracking.FlopTally`)
    bytes_touched: int = 0


_entries: "weakref.WeakKeyDictionary[nn.Module, OrderedDict[Hashable, CachedCall]]" = weakref.WeakKeyDictionary()
# Every entry by its key, whichever module it was estimated on: an identical module's answer (held while a module
# keeps it in `_entries`).
_by_key: "weakref.WeakValueDictionary[Hashable, CachedCall]" = weakref.WeakValueDictionary()


def cache_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1") != "0"


def cache_key(module: nn.Module, method: str, inputs: Any, dtype: torch.dtype | None) -> Hashable | None:
    """The key of `module.<method>(*inputs)` at `dtype` (module doc), or None when it is not to be cached."""
    if not cache_enabled() or not only_observed(module.modules()):
        return None
    signature = call_signature(inputs)
    if signature is None:
        return None
    # The memo's switch too: with it off, an estimate is a full run, never an answer the memo helped make.
    return method, dtype, torch.get_default_dtype(), memo_enabled(), signature, module_state(module)


def cached(module: nn.Module, key: Hashable | None) -> CachedCall | None:
    """The remembered call (its observers told of its calls, its output a fresh copy), or None."""
    if key is None:
        return None
    entry = _entries.get(module, {}).get(key)
    if entry is None:
        entry = _by_key.get(key)  # estimated on another module in the same state (module doc)
        if entry is None:
            return None
        remember(module, key, entry)
    notify_paths(module, entry.calls)
    return dataclasses.replace(entry, output=to_meta(entry.output))


def remember(module: nn.Module, key: Hashable | None, call: CachedCall) -> None:
    if key is None:
        return
    entries = _entries.setdefault(module, OrderedDict())
    entries[key] = _by_key[key] = call
    while len(entries) > _PER_MODULE:
        entries.popitem(last=False)


def forget(module: nn.Module | None = None) -> None:
    """Drop the remembered calls of `module` (of every module when None)."""
    if module is None:
        _entries.clear()
        _by_key.clear()
    else:
        _entries.pop(module, None)
