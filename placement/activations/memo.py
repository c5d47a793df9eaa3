"""Estimates not run twice: a repeated block called with inputs seen before is replayed (`BlockMemo`, within one
estimate), and a call estimated before on an unchanged module is answered from memory (the cache, across
plans). Both key on `calls.call_signature` and `calls.module_state`, and tell `CallObserver`s of the calls
they skip.

Repeated calls estimated once: a block called with inputs an identical block (or itself) was called with before
is replayed, not run.

A FLUX DiT runs 57 blocks of two kinds, Wan 40 of one, T5-XXL 24; a causal video VAE (Wan's) runs its decoder
once per latent frame, 21 times for 81 frames: each such call on fake tensors costs as much as the first and tells
nothing new. The candidates, within one estimate:

- the members of a `ModuleList` or `nn.Sequential` that have submodules and share their class and parameter
  shapes with another member (the repeated blocks of a DiT or a text encoder);
- the children of the estimated module that have submodules (a VAE's `encoder` and `decoder`, which its
  `_encode`/`_decode` call in a loop over frames).

When a candidate is called and an identical block (`calls.module_state`, the layer index left out) was
called before with the same inputs (`calls.call_signature`, where a view starts in its storage left out:
`calls`), and with its lists and dicts aliased alike, the call is replayed (`Effects.apply`):

- its transient: an empty storage of the first run's peak above the live bytes at its entry is allocated and
  freed at once, so every tracker sees the peak a full run reaches (the storages a block allocates and frees do
  not depend on what was live before it: its inputs are held by its caller for the whole call, and the cache
  entries it replaces are freed as they were, checked);
- its outputs and writes: new empty tensors of the recorded shapes, strides and dtypes, storages shared as they
  were; an output that was an input is that input again, a view of an input the same view of it; the lists and
  dicts it was given (Wan's `feat_cache` and `feat_idx`) hold what the run left in them. The live bytes after the
  call are the full run's;
- its FLOPs and bytes touched (`tracking.FlopTally`): the first run's, counted again;
- its submodules' calls, in order, reported to their `CallObserver`s (`record_module_order`), so the order a
  split is cut in does not change.

A first run is recorded only when what it did can be described (`calls`), checked on the tracker: the
block's own state is as it was, the storages it freed were inputs it dropped from a list or dict, and the ones it
left alive are exactly those of its outputs and of what it wrote into its lists and dicts (a block that stashes a
tensor on itself is run every time). Blocks carrying hooks other than observers, or a `forward` wrapped by other
code, are never replayed. A replay that finds the frees differ from its run's stops the memo for this estimate,
which runs again without it (`ReplayDiverged`). `PLACEMENT_BLOCK_MEMO=0` turns the memo off (for A/B runs).

Estimates reused across plans: a call estimated once is answered from memory while nothing it depends on
has changed.

A load plans several times (formats, VAE techniques, suggestions, what-would-fit offers), and a pipeline's
`__call__` run on stand-ins calls each component once per step with the same inputs: each distinct call is
estimated once. The key is everything the estimate depends on: the module's state (`calls.module_state`:
classes, parameter and buffer shapes and dtypes, plain attributes such as a VAE's `use_tiling`), the method,
the inputs' signature, the dtype the weights are cast to, torch's default dtype, and whether the block memo is
on. So weights re-cast, a technique toggled or a processor swapped in between give another key: a changed
module never gets a stale answer.

A module whose state equals one estimated before gets that one's answer: the key holds everything the estimate
depends on, so Wan 2.2 A14B's two experts (one config, other weights) are one estimate, not two.

Entries are held per module, weakly (a module freed drops its entries), at most `_PER_MODULE` of them. A call is
never cached when its inputs hold something other than tensors and plain values, or when a module in it carries
hooks other than `CallObserver`s (they would not see a call answered from memory; the observers are told the
recorded calls). `PLACEMENT_ESTIMATE_CACHE=0` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn

from .calls import BLOCK_INDEX_ATTRIBUTES, Effects, Entry, ReplayDiverged, call_signature, module_state
from .fake_tensors import to_meta
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

    @contextlib.contextmanager
    def installed(self, root: nn.Module) -> Iterator[None]:
        """Within it, `root`'s candidate blocks go through the memo (their `forward` patched, then restored)."""
        patched = []
        try:
            # Decided before any is patched: a candidate holding others would see their wrappers as foreign.
            chosen = [(group, block) for group, blocks in candidates(root).items() for block in blocks
                      if only_observed(block.modules())]
            for group, block in chosen:
                patched.append((block, block.__dict__.get("forward")))
                block.forward = functools.partial(self._call, group, block, block.forward)
            yield
        finally:
            for block, own in reversed(patched):
                if own is None:
                    del block.forward
                else:
                    block.forward = own

    def _call(self, group: Hashable, block: nn.Module, forward: Callable, *args, **kwargs) -> Any:
        off = self.diverged or self._failures.get(group, 0) >= _GIVE_UP
        signature = None if off else call_signature((args, kwargs), offsets=False)
        if signature is None:
            return forward(*args, **kwargs)
        entry = Entry.of((args, kwargs))
        identity = module_state(block, ignore=_IDENTITY_IGNORES)
        key = (identity, signature, entry.layout)
        record = self._records.get(key)
        if record is not None:
            self._tally.add(record.flops, record.bytes_touched)  # the same work as its first run
            try:
                with self._tally.paused():  # its stand-in tensors are no work
                    return record.replay(block, (args, kwargs), self._tracker)
            except ReplayDiverged:
                self.diverged = True
                raise
        before, live, start = self._tracker.counted_storages(), self._tracker.live_bytes, len(self._log.calls)
        flops, touched = self._tally.flops, self._tally.bytes_touched
        with self._tracker.window() as window:
            output = forward(*args, **kwargs)
        effects = None
        if module_state(block, ignore=_IDENTITY_IGNORES) == identity:
            effects = Effects.of(output, (args, kwargs), entry, before, self._tracker.counted_storages(),
                                 grown=self._tracker.live_bytes - live)
        if effects is None:
            self._failures[group] = self._failures.get(group, 0) + 1
        else:
            self._records[key] = _Record(transient_bytes=window.transient_bytes, effects=effects,
                                         flops=self._tally.flops - flops, bytes_touched=self._tally.bytes_touched - touched,
                                         children=self._log.paths(block, start, len(self._log.calls)))
        return output


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
    return CachedCall(peak_bytes=entry.peak_bytes, output=to_meta(entry.output), calls=entry.calls,
                      flops=entry.flops, bytes_touched=entry.bytes_touched)


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
