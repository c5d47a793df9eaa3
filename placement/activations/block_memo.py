"""Repeated calls estimated once: a block called with inputs an identical block (or itself) was called with before
is replayed, not run.

A FLUX DiT runs 57 blocks of two kinds, Wan 40 of one, T5-XXL 24; a causal video VAE (Wan's) runs its decoder
once per latent frame, 21 times for 81 frames: each such call on fake tensors costs as much as the first and tells
nothing new. The candidates, within one estimate:

- the members of a `ModuleList` or `nn.Sequential` that have submodules and share their class and parameter
  shapes with another member (the repeated blocks of a DiT or a text encoder);
- the children of the estimated module that have submodules (a VAE's `encoder` and `decoder`, which its
  `_encode`/`_decode` call in a loop over frames).

When a candidate is called and an identical block (`signatures.module_state`, the layer index left out) was
called before with the same inputs (`signatures.call_signature`, where a view starts in its storage left out:
`call_effects`), and with its lists and dicts aliased alike, the call is replayed (`call_effects.Effects.apply`):

- its transient: an empty storage of the first run's peak above the live bytes at its entry is allocated and
  freed at once, so every tracker sees the peak a full run reaches (the storages a block allocates and frees do
  not depend on what was live before it: its inputs are held by its caller for the whole call, and the cache
  entries it replaces are freed as they were, checked);
- its outputs and writes: new empty tensors of the recorded shapes, strides and dtypes, storages shared as they
  were; an output that was an input is that input again, a view of an input the same view of it; the lists and
  dicts it was given (Wan's `feat_cache` and `feat_idx`) hold what the run left in them. The live bytes after the
  call are the full run's;
- its FLOPs and bytes touched (`flops.FlopTally`): the first run's, counted again;
- its submodules' calls, in order, reported to their `CallObserver`s (`record_module_order`), so the order a
  split is cut in does not change.

A first run is recorded only when what it did can be described (`call_effects`), checked on the tracker: the
block's own state is as it was, the storages it freed were inputs it dropped from a list or dict, and the ones it
left alive are exactly those of its outputs and of what it wrote into its lists and dicts (a block that stashes a
tensor on itself is run every time). Blocks carrying hooks other than observers, or a `forward` wrapped by other
code, are never replayed. A replay that finds the frees differ from its run's stops the memo for this estimate,
which runs again without it (`ReplayDiverged`). `PLACEMENT_BLOCK_MEMO=0` turns the memo off (for A/B runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn

from .call_effects import Effects, Entry, ReplayDiverged
from .flops import FlopTally
from .observers import CallLog, notify_paths, only_observed
from .signatures import BLOCK_INDEX_ATTRIBUTES, call_signature, module_state
from .tracker import LiveStorageTracker

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
