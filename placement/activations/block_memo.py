"""Identical blocks estimated once: a block called with inputs an identical block was called with is replayed.

A FLUX DiT runs 57 blocks of two kinds, Wan 40 of one, T5-XXL 24: each one's call on fake tensors costs as
much as the first of its kind, and tells nothing new. Within one estimate, the members of a `ModuleList` or
`nn.Sequential` that have submodules and that share their class and parameter shapes with another member are
candidates; when a candidate is called and an identical block (`signatures.module_state`, the layer index left
out) was called before with the same inputs (`signatures.call_signature`), the call is replayed:

- its transient: an empty storage of the first run's peak above the live bytes at its entry is allocated and
  freed at once, so every tracker sees the peak a full run reaches (the storages a block allocates and frees do
  not depend on what was live before it: its inputs are held by its caller for the whole call);
- its outputs: new empty tensors of the recorded shapes, strides, offsets and dtypes, storages shared as they
  were; an output that was an input (a block returning its input) is that input again, a view of an input is
  the same view of it, so the live bytes after the call are the full run's too;
- its FLOPs and bytes touched (`flops.FlopTally`): the first run's, counted again;
- its submodules' calls, in order, reported to their `CallObserver`s (`record_module_order`), so the order a
  split is cut in does not change.

A first run is recorded only when the block behaved as a pure function of its inputs, checked on the tracker:
its inputs and its own state are as they were, every storage alive at entry still is, and the storages it
left alive are exactly those of its outputs (a block that stashes a tensor or writes into a list argument, as
a causal video VAE's frame cache does, is run every time). Blocks carrying hooks other than observers, or a
`forward` wrapped by other code, are never replayed. `PLACEMENT_BLOCK_MEMO=0` turns the memo off (for A/B runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .flops import FlopTally
from .observers import CallLog, notify_paths, only_observed
from .signatures import BLOCK_INDEX_ATTRIBUTES, call_signature, module_state
from .tracker import LiveStorageTracker, storage_key

MEMO_ENV = "PLACEMENT_BLOCK_MEMO"
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
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
        # Candidates whose first runs were not replayable (a causal VAE's blocks writing into their cache
        # list), by group: after `_GIVE_UP` of those, the group runs without the memo's bookkeeping.
        self._failures: dict[Hashable, int] = {}

    @contextlib.contextmanager
    def installed(self, root: nn.Module) -> Iterator[None]:
        """Within it, `root`'s candidate blocks go through the memo (their `forward` patched, then restored)."""
        patched = []
        try:
            for group, blocks in repeated_blocks(root).items():
                for block in blocks:
                    if only_observed(block.modules()):
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
        signature = None if self._failures.get(group, 0) >= _GIVE_UP else call_signature((args, kwargs))
        if signature is None:
            return forward(*args, **kwargs)
        identity = module_state(block, ignore=_IDENTITY_IGNORES)
        record = self._records.get((identity, signature))
        if record is not None:
            self._tally.add(record.flops, record.bytes_touched)  # the same work as its first run
            with self._tally.paused():  # its stand-in tensors are no work
                return record.replay(block, args, kwargs)
        before, start = self._tracker.counted_storages(), len(self._log.calls)
        flops, touched = self._tally.flops, self._tally.bytes_touched
        with self._tracker.window() as window:
            output = forward(*args, **kwargs)
        unchanged = call_signature((args, kwargs)) == signature and \
            module_state(block, ignore=_IDENTITY_IGNORES) == identity
        outputs = _Outputs.of(output, args, kwargs, before, self._tracker.counted_storages()) if unchanged else None
        if outputs is None:
            self._failures[group] = self._failures.get(group, 0) + 1
        else:
            self._records[(identity, signature)] = _Record(
                transient_bytes=window.transient_bytes, outputs=outputs, flops=self._tally.flops - flops,
                bytes_touched=self._tally.bytes_touched - touched,
                children=self._log.paths(block, start, len(self._log.calls)))
        return output


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
    outputs: "_Outputs"
    flops: int = 0  # what its first run computed and touched, counted again at each replay
    bytes_touched: int = 0
    children: tuple[str, ...]  # the block's submodules called, in order, by path under the block

    def replay(self, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        transient = torch.empty(self.transient_bytes, dtype=torch.uint8, device="meta")
        del transient  # the first run's peak above the live bytes at entry, reached for an instant
        notify_paths(block, self.children)
        return self.outputs.build(args, kwargs)


@dataclass(frozen=True, kw_only=True)
class _Outputs:
    """A call's outputs described against its inputs: per leaf of the output pytree, a plain value, an input
    ("same"), a view of an input's storage ("view"), a tensor alone in a storage the call allocated ("fresh"), or
    a view of a storage the call allocated and several outputs share ("new")."""

    spec: Any
    leaves: tuple
    storages: tuple[int, ...]  # bytes of each shared storage the call allocated and returned

    @classmethod
    def of(cls, output: Any, args: tuple, kwargs: dict, before: frozenset[int],
           after: frozenset[int]) -> "_Outputs | None":
        """The description, or None when the call did more than return these outputs (module doc)."""
        if not before <= after:
            return None  # it freed a storage alive at its entry
        inputs = tree_flatten((args, kwargs))[0]
        leaves, spec = tree_flatten(output)
        allocated = after - before
        users: dict[int, int] = {}  # storage key -> how many output tensors use it
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                users[storage_key(leaf)] = users.get(storage_key(leaf), 0) + 1
        if not allocated <= set(users):
            return None  # it left something alive besides its outputs
        shared: dict[int, int] = {}  # storage key -> index in `storages`
        described = [_describe(leaf, inputs, allocated, users, shared) for leaf in leaves]
        if any(item is None for item in described):
            return None
        storages = [0] * len(shared)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and storage_key(leaf) in shared:
                storages[shared[storage_key(leaf)]] = leaf.untyped_storage().nbytes()
        return cls(spec=spec, leaves=tuple(described), storages=tuple(storages))

    def build(self, args: tuple, kwargs: dict) -> Any:
        inputs = tree_flatten((args, kwargs))[0]
        bases = [torch.empty(nbytes, dtype=torch.uint8, device="meta") for nbytes in self.storages]
        leaves = []
        for kind, *rest in self.leaves:
            if kind == "plain":
                leaves.append(rest[0])
            elif kind == "same":
                leaves.append(inputs[rest[0]])
            elif kind == "view":
                leaves.append(inputs[rest[0]].as_strided(*rest[1]))
            elif kind == "fresh":
                leaves.append(torch.empty_strided(*rest[1][:2], dtype=rest[0], device="meta"))
            else:
                leaves.append(bases[rest[0]].view(rest[1]).as_strided(*rest[2]))
        return tree_unflatten(leaves, self.spec)


def _describe(leaf: Any, inputs: list, allocated: frozenset[int], users: dict[int, int],
              shared: dict[int, int]) -> tuple | None:
    """One output leaf as `_Outputs` describes it, or None when it cannot be rebuilt."""
    if not isinstance(leaf, torch.Tensor):
        return ("plain", leaf) if isinstance(leaf, _PLAIN) else None
    same = next((index for index, given in enumerate(inputs) if given is leaf), None)
    if same is not None:
        return "same", same
    key, layout = storage_key(leaf), (tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset())
    owner = next((index for index, given in enumerate(inputs)
                  if isinstance(given, torch.Tensor) and storage_key(given) == key), None)
    if owner is not None:
        return ("view", owner, layout) if inputs[owner].dtype == leaf.dtype else None
    nbytes = leaf.untyped_storage().nbytes()
    if key not in allocated or leaf.device.type != "meta" or nbytes % leaf.element_size():
        return None  # a view of something else alive (a weight, a stashed tensor): not replayable
    if users[key] == 1 and leaf.storage_offset() == 0 and nbytes == _strided_bytes(leaf):
        return "fresh", leaf.dtype, layout  # what empty_strided gives back: one op to rebuild
    shared.setdefault(key, len(shared))
    return "new", shared[key], leaf.dtype, layout


def _strided_bytes(tensor: torch.Tensor) -> int:
    """The bytes `torch.empty_strided(tensor.shape, tensor.stride())` allocates."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) \
        * tensor.element_size()
