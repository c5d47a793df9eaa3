"""The streaming engine under group offloading and per-call residency: groups of modules whose weights are
onloaded together before use and offloaded together after, which modules form them, and regrouping after edits.

Block level: the blocks of every block list (`placement.streaming.block_groups`, the layout the planner sizes)
cut into runs of `num_blocks_per_group`, plus one "rest" group onloaded while the root or any other module runs.
Leaf level: every module holding tensors itself. Groups sharing a tensor (tied weights) are merged.

An edit in place (an adapter loaded, fused, unloaded) changes tensors under groups built before; `regroup`
re-runs the grouping and reconciles: replaced tensors are re-stored, gone ones forgotten, new ones join the group
of their unit (or form a new group for the caller to hook). Old tensors never change group, so a regroup moves
only the bytes that changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from placement.devices import Device
from placement.device_maps import owning_key
from placement.streaming import block_groups

from .read_ahead import read_ahead
from .storage import CheckpointStore, DiskStore, HostStore
from .transfer import BlockingTransfer, PendingCopy, StreamTransfer
from .. import trace
from .. import transfer_meter as meter
from ..tensor_slots import ModelTensor, collect_entries, direct_tensor_ids


class GroupState(Enum):
    OFFLOADED = "offloaded"  # the module holds the store's form (host tensor or meta)
    ONLOADED = "onloaded"  # possibly still being copied on a side stream
    PLAIN = "plain"  # not (or no longer) offloaded: the group is inert


class ReleaseRule(Enum):
    AFTER_LAST_MODULE = "after_last_module"  # a run of blocks: after the last block of the run returns
    WHEN_IDLE = "when_idle"  # everything else: when no module of the group is running any more


class ModuleGroup:
    """Onloads/offloads the entries of `spec` as one unit; its `modules` are those whose calls drive it, in order."""

    def __init__(self, spec: GroupSpec, *, store: HostStore | DiskStore | CheckpointStore,
                 transfer: BlockingTransfer | StreamTransfer, onload_device: torch.device,
                 onload_place: Device) -> None:
        self.name = spec.name
        self.modules = tuple(spec.modules)
        self.entries = tuple(spec.entries)
        self.release = spec.release
        self.onload_device = onload_device
        self.onload_place = onload_place
        self.store = store
        self.transfer = transfer
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)
        self.original_devices = {entry.key: entry.get().device for entry in self.entries}
        self.state = GroupState.PLAIN  # until `take_weights`
        self.active_calls = 0
        self._unused = False  # onloaded and not used yet
        self._pending: PendingCopy | None = None
        # Disk-homed and prefetched (`read_ahead`): its onload runs on the reader thread.
        self.reads_ahead = False
        self._reading: Future[PendingCopy] | None = None

    def __repr__(self) -> str:
        return f"ModuleGroup({self.name!r}, {len(self.entries)} tensors, {self.num_bytes} bytes, {self.state.value})"

    @property
    def is_onloaded(self) -> bool:
        return self.state is GroupState.ONLOADED

    def take_weights(self) -> None:
        self.store.take(self.entries)
        self.state = GroupState.OFFLOADED

    def onload(self) -> bool:
        """Start bringing the weights to the onload device; True when this call started it."""
        if self.state is not GroupState.OFFLOADED:
            return False
        side = getattr(self.transfer, "stream", None)  # a CUDA side stream times the copy itself
        trace.copy_issued(self, self.onload_device, side)
        if self.reads_ahead:
            self._reading = read_ahead(lambda: self._read_and_copy(side))
        else:
            self._take(self._read_and_copy(side))
        meter.record(meter.Payload.WEIGHTS, self.num_bytes, source=self.store.home, target=self.onload_place)
        self.state = GroupState.ONLOADED
        self._unused = True
        return True

    def _read_and_copy(self, side) -> PendingCopy:
        sources = self.store.read(pinned=self.transfer.uses_pinned_memory, device=self.onload_device)
        pending = self.transfer.copy(sources, self.onload_device)
        trace.copy_done(self, self.onload_device, side)
        return pending

    def _take(self, pending: PendingCopy) -> None:
        self._pending = pending
        for entry in self.entries:
            entry.set(pending.tensors[entry.key])

    def wait_until_ready(self) -> None:
        """Take a read-ahead's tensors, then make the current stream wait for the copy."""
        if self._reading is not None:
            reading, self._reading = self._reading, None
            self._take(reading.result())
        if self._pending is not None:
            self.transfer.wait(self._pending)
            self._pending = None

    def enter(self) -> bool:
        """A module of the group is about to run: count it, onload if needed. True for the first use since the
        weights came: the moment to prefetch the next group, once per visit rather than once per module."""
        self.active_calls += 1
        self.onload()
        first_use, self._unused = self._unused, False
        return first_use

    def leave(self, module: nn.Module) -> None:
        self.active_calls = max(0, self.active_calls - 1)
        run_done = self.release is ReleaseRule.AFTER_LAST_MODULE and module is self.modules[-1]
        if run_done or (self.release is ReleaseRule.WHEN_IDLE and self.active_calls == 0):
            self.offload()

    def offload(self) -> None:
        if self.state is not GroupState.ONLOADED:
            return
        self.wait_until_ready()
        self.store.release(self.entries)
        self.state = GroupState.OFFLOADED

    def reset(self) -> None:
        """Forget running calls (a previous call may have raised mid-forward) and offload."""
        self.active_calls = 0
        self.offload()

    def adopt(self, entries: Sequence[ModelTensor]) -> None:
        """Make `entries` (tensors added while the group was offloaded, e.g. an adapter's) part of the group."""
        self.offload()
        for entry in entries:
            self.original_devices[entry.key] = entry.get().device
        self.store.take(entries)
        self.entries += tuple(entries)
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def forget(self, entries: Sequence[ModelTensor]) -> None:
        keys = {entry.key for entry in entries}
        self.store.forget(keys)
        self.entries = tuple(entry for entry in self.entries if entry.key not in keys)
        for key in keys:
            self.original_devices.pop(key, None)
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def store_edits(self) -> None:
        """Re-store the entries whose tensor was replaced while offloaded (`param.data = fused`)."""
        changed = [entry for entry in self.entries if not self.store.holds(entry)]
        if changed:
            self.store.take(changed)
            self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def restore(self) -> None:
        """Plain weights back on their original devices (idempotent)."""
        if self.state is GroupState.PLAIN:
            return
        self.wait_until_ready()
        self.store.restore(self.entries, self.original_devices)
        self.state = GroupState.PLAIN


def make_transfer(device: torch.device, use_stream: bool) -> BlockingTransfer | StreamTransfer:
    return StreamTransfer(device) if use_stream else BlockingTransfer()


def onload_together(groups: Iterable[ModuleGroup]) -> None:
    """Onload `groups`, every copy started before any is waited for (copies to several devices overlap)."""
    started = [group for group in groups if group.onload()]
    for group in started:
        group.wait_until_ready()


class OffloadType(str, Enum):
    BLOCK_LEVEL = "block_level"
    LEAF_LEVEL = "leaf_level"


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupSpec:
    """`modules` get the hook (the last one ends a run of blocks), `entries` move together."""

    name: str
    modules: tuple[nn.Module, ...]
    entries: tuple[ModelTensor, ...]
    release: ReleaseRule


@dataclass(kw_only=True, eq=False)
class _Draft:
    name: str
    modules: list[nn.Module]
    owned: list[nn.Module]  # modules whose *direct* tensors belong to this group
    release: ReleaseRule


def plan_groups(root: nn.Module, offload_type: OffloadType, num_blocks_per_group: int, *, under: str = "",
                entries: dict[int, ModelTensor] | None = None) -> list[GroupSpec]:
    """The groups of `root` (of its submodule `under`, named from `root`; `entries`: `collect_entries(root)`)."""
    part = root.get_submodule(under)
    drafts = _block_drafts(part, num_blocks_per_group) if offload_type is OffloadType.BLOCK_LEVEL else [
        _Draft(name=name or "root", modules=[module], owned=[module], release=ReleaseRule.WHEN_IDLE)
        for name, module in part.named_modules() if direct_tensor_ids(module)]
    entries = collect_entries(root) if entries is None else entries
    drafts = _merge_tied(drafts, entries)
    prefix = f"{under}." if under else ""
    return [spec for draft in drafts if (spec := _spec(draft, entries, prefix)) is not None]


def whole_group(root: nn.Module, under: str, entries: dict[int, ModelTensor]) -> GroupSpec | None:
    """One group of every tensor of `root`'s submodule `under` (None: it holds none)."""
    part = root.get_submodule(under)
    draft = _Draft(name=under or "root", modules=[part], owned=list(part.modules()),
                   release=ReleaseRule.AFTER_LAST_MODULE)
    return _spec(draft, entries, "")


def held_tensor(module: nn.Module, path: str) -> torch.Tensor | None:
    """The parameter or buffer `path` names (the planner's units name a loose tensor such as a root-level
    `scale_shift_table` by its path), or None."""
    owner, _, name = path.rpartition(".")
    try:
        holder = module.get_submodule(owner)
    except AttributeError:
        return None
    if name in holder._parameters:
        return holder._parameters[name]
    return holder._buffers.get(name)


def unit_specs(module: nn.Module, path: str, block_paths: list[str], entries) -> list[GroupSpec]:
    """Per-call residency's units for its listed `path` (`block_paths`: the component's blocks): a held tensor
    alone, a block (or a part without block lists) whole, else the part's blocks one by one and its rest."""
    tensor = held_tensor(module, path)
    if tensor is not None:  # a tensor held outside any block: one unit of its own, loaded per call
        return [GroupSpec(name=path, modules=(), entries=(entries[id(tensor)],),
                          release=ReleaseRule.AFTER_LAST_MODULE)]
    in_block = any(owning_key(path, [block]) is not None for block in block_paths)
    if in_block or not block_groups(module.get_submodule(path)).block_lists:
        spec = whole_group(module, path, entries)
        return [] if spec is None else [spec]
    return plan_groups(module, OffloadType.BLOCK_LEVEL, 1, under=path, entries=entries)


def _spec(draft: _Draft, entries: dict[int, ModelTensor], prefix: str) -> GroupSpec | None:
    tensor_ids = dict.fromkeys(tid for module in draft.owned for tid in direct_tensor_ids(module))
    group_entries = tuple(entries[tid] for tid in tensor_ids)
    if not group_entries:
        return None
    return GroupSpec(name=prefix + draft.name, modules=tuple(draft.modules), entries=group_entries,
                     release=draft.release)


def _block_drafts(root: nn.Module, num_blocks_per_group: int) -> list[_Draft]:
    layout = block_groups(root)
    drafts, claimed = [], set()
    for block_list in layout.block_lists:
        blocks = block_list.blocks
        for start in range(0, len(blocks), num_blocks_per_group):
            run = blocks[start : start + num_blocks_per_group]
            owned = [m for _, block in run for m in block.modules() if id(m) not in claimed]
            claimed.update(id(m) for m in owned)
            first, last = run[0][0], run[-1][0].rsplit(".", 1)[-1]
            drafts.append(_Draft(name=first if run[0][0] == run[-1][0] else f"{first}-{last}",
                                 modules=[block for _, block in run], owned=owned,
                                 release=ReleaseRule.AFTER_LAST_MODULE))
    # The root is always hooked (it drives the session); a module shared with a block belongs to the block.
    rest_modules = [root, *(m for path, m in layout.rest_modules if path and id(m) not in claimed)]
    rest_owned = [m for m in root.modules() if id(m) not in claimed]
    rest = _Draft(name="rest", modules=rest_modules, owned=rest_owned, release=ReleaseRule.WHEN_IDLE)
    return [rest, *drafts]


def _merge_tied(drafts: list[_Draft], entries: dict[int, ModelTensor]) -> list[_Draft]:
    """Union the drafts whose owned modules share a tensor; keeps first-seen order."""
    owner = {id(m): index for index, draft in enumerate(drafts) for m in draft.owned}
    parent = list(range(len(drafts)))

    def find(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for entry in entries.values():
        groups = {owner[id(slot.module)] for slot in entry.slots if id(slot.module) in owner}
        if not groups:
            continue
        first, *others = sorted(groups)
        for other in others:
            parent[find(other)] = find(first)

    merged: dict[int, _Draft] = {}
    for index, draft in enumerate(drafts):
        head = find(index)
        if head not in merged:
            merged[head] = _Draft(name=draft.name, modules=list(draft.modules), owned=list(draft.owned),
                                  release=draft.release)
            continue
        target = merged[head]
        target.name = f"{target.name}+{draft.name}"
        target.modules += [m for m in draft.modules if all(m is not known for known in target.modules)]
        target.owned += draft.owned
        if draft.release is not target.release:
            target.release = ReleaseRule.WHEN_IDLE
    return list(merged.values())


@dataclass(kw_only=True, eq=False)
class Regrouped:
    """Groups made for units of new tensors only (with their specs), and groups left empty."""

    added: list[tuple[GroupSpec, ModuleGroup]] = field(default_factory=list)
    emptied: list[ModuleGroup] = field(default_factory=list)


def regroup(root: nn.Module, groups: Sequence[ModuleGroup],
            specs_for: Callable[[dict[int, ModelTensor]], Iterable[GroupSpec]],
            new_group: Callable[[GroupSpec, tuple[ModelTensor, ...]], ModuleGroup]) -> Regrouped:
    """Reconcile `groups` with `root` as it is now. `specs_for(entries)`: the technique's grouping of the
    current tensors; `new_group(spec, entries)` builds and fills the group of a unit of new tensors only."""
    for group in groups:
        group.offload()
        group.store_edits()
    live = collect_entries(root)
    for group in groups:
        gone = [entry for entry in group.entries if id(entry.get()) not in live]
        if gone:
            group.forget(gone)
    owner = {id(entry.get()): group for group in groups for entry in group.entries}
    result = Regrouped()
    claimed: set[int] = set()  # ModelTensors already placed (a tied tensor shows up in two specs)
    for spec in specs_for(live):
        # A new tensor without data (created on meta) is left out: the caller reports it, no store can take it.
        fresh = tuple(entry for entry in spec.entries
                      if id(entry.get()) not in owner and id(entry) not in claimed and not entry.get().is_meta)
        if not fresh:
            continue
        claimed.update(id(entry) for entry in fresh)
        homes = Counter(owner[id(entry.get())] for entry in spec.entries if id(entry.get()) in owner)
        if homes:
            target = homes.most_common(1)[0][0]
            target.adopt(_unique_keys(fresh, target))
        else:
            result.added.append((spec, new_group(spec, fresh)))
    result.emptied = [group for group in groups if not group.entries]
    return result


def _unique_keys(entries: tuple[ModelTensor, ...], group: ModuleGroup) -> tuple[ModelTensor, ...]:
    """`entries`, renamed where a key is already used in `group` (a new tensor may take a gone one's name)."""
    used = {entry.key for entry in group.entries}
    renamed = []
    for entry in entries:
        key, suffix = entry.key, 1
        while key in used:
            key, suffix = f"{entry.key}#{suffix}", suffix + 1
        used.add(key)
        renamed.append(entry if key == entry.key else ModelTensor(key=key, slots=entry.slots))
    return tuple(renamed)


__all__ = ["GroupSpec", "GroupState", "ModuleGroup", "OffloadType", "Regrouped", "ReleaseRule", "make_transfer",
           "held_tensor", "onload_together", "plan_groups", "regroup", "unit_specs", "whole_group"]
