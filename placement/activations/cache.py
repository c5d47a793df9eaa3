"""Estimates reused across plans: a call estimated once is answered from memory while nothing it depends on
has changed.

A load plans several times (formats, VAE techniques, suggestions, what-would-fit offers), and a pipeline's
`__call__` run on stand-ins calls each component once per step with the same inputs: each distinct call is
estimated once. The key is everything the estimate depends on: the module's state (`signatures.module_state`:
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

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import nn

from .block_memo import memo_enabled
from .meta_outputs import to_meta
from .observers import notify_paths, only_observed
from .signatures import call_signature, module_state

CACHE_ENV = "PLACEMENT_ESTIMATE_CACHE"
_PER_MODULE = 64  # distinct calls remembered per module (the oldest goes first)


@dataclass(frozen=True, kw_only=True)
class CachedCall:
    peak_bytes: int
    output: Any  # meta tensors (`to_meta`), copied again for each answer so no caller sees another's changes
    calls: tuple[str, ...]  # the module's submodules called, in order, by path (for the observers)
    flops: int = 0  # what the call computes and touches (`flops.FlopTally`)
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
