"""Which modules form which offload group (pure bookkeeping: nothing moves here).

Block level: the blocks of every block list `placement.streaming.block_groups` finds (an `nn.ModuleList` /
`nn.Sequential` at any depth: T5's `encoder.block`, a VAE's `decoder.up_blocks`; the planner sizes offloaded
components from the same layout) are cut into runs of `num_blocks_per_group`; everything else (the tensors
of the root, of the modules descended through and of every other child) forms one "rest" group, onloaded
while the root or any of those modules runs.
Leaf level: every module that holds tensors itself (each leaf layer, and any parent with direct parameters)
is its own group.
Groups that share a tensor (tied weights) are merged so a tensor is never offloaded while still in use.
Per-call residency cuts parts of a component the same way: `under` names the part, tensors keep their names
relative to the component (`entries`), and `whole_group` makes one group of a part that is itself a block.

Regrouping (`regroup`) keeps a module's groups in step with the module after it was edited in place. An
adapter loaded into an offloaded module (peft wraps a layer and adds its matrices beside it), fused into its
weights, or unloaded again changes the module's tensors under groups built before: new tensors sit outside
every group (left in host RAM while their layer computes on the accelerator), replaced ones leave the store
holding stale data, removed ones keep moving. Regrouping, with every group offloaded, runs the technique's own
grouping over the module as it is now and reconciles:
- a tensor the store no longer matches (`param.data = merged`) is taken again;
- a tensor gone from the module is dropped from its group (and from its store);
- a new tensor joins the group that holds the other tensors of its unit (a LoRA inside a block joins the
  block); a unit made of new tensors only (a new leaf at leaf level) becomes a new group, for the caller to hook;
- a group left without tensors is reported, for the caller to unhook.
Old tensors never change group, and the store keeps them where they are (pinned memory stays pinned; disk
placeholders are not read), so a regroup moves only the bytes that changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from torch import nn

from placement.streaming import block_groups

from .module_group import ModuleGroup, ReleaseRule
from ..tensor_slots import ModelTensor, collect_entries, direct_tensor_ids


class OffloadType(str, Enum):
    BLOCK_LEVEL = "block_level"
    LEAF_LEVEL = "leaf_level"


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupSpec:
    """A group to build: `modules` get the hook (the last one ends a run of blocks), `entries` move together."""

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
    if offload_type is OffloadType.BLOCK_LEVEL:
        drafts = _block_drafts(part, num_blocks_per_group)
    else:
        drafts = _leaf_drafts(part)
    entries = collect_entries(root) if entries is None else entries
    drafts = _merge_tied(drafts, entries)
    prefix = f"{under}." if under else ""
    return [spec for draft in drafts if (spec := _spec(draft, entries, prefix)) is not None]


def whole_group(root: nn.Module, under: str, entries: dict[int, ModelTensor]) -> GroupSpec | None:
    """One group of every tensor of `root`'s submodule `under`, onloaded while it runs, released when it
    returns (a block: never looked into; None: it holds no tensor)."""
    part = root.get_submodule(under)
    draft = _Draft(name=under or "root", modules=[part], owned=list(part.modules()),
                   release=ReleaseRule.AFTER_LAST_MODULE)
    return _spec(draft, entries, "")


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
            drafts.append(
                _Draft(
                    name=first if run[0][0] == run[-1][0] else f"{first}-{last}",
                    modules=[block for _, block in run],
                    owned=owned,
                    release=ReleaseRule.AFTER_LAST_MODULE,
                )
            )
    # The root is always hooked (it drives the session); a module shared with a block belongs to the block.
    rest_modules = [root, *(m for path, m in layout.rest_modules if path and id(m) not in claimed)]
    rest_owned = [m for m in root.modules() if id(m) not in claimed]
    rest = _Draft(name="rest", modules=rest_modules, owned=rest_owned, release=ReleaseRule.WHEN_IDLE)
    return [rest, *drafts]


def _leaf_drafts(root: nn.Module) -> list[_Draft]:
    return [
        _Draft(name=name or "root", modules=[module], owned=[module], release=ReleaseRule.WHEN_IDLE)
        for name, module in root.named_modules()
        if direct_tensor_ids(module)
    ]


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
    """What a regroup changed: groups made for units of new tensors only (with their specs), and groups left
    empty; `adopted` counts the new tensors that joined existing groups."""

    added: list[tuple[GroupSpec, ModuleGroup]] = field(default_factory=list)
    emptied: list[ModuleGroup] = field(default_factory=list)
    adopted: int = 0


def regroup(root: nn.Module, groups: Sequence[ModuleGroup],
            specs_for: Callable[[dict[int, ModelTensor]], Iterable[GroupSpec]],
            new_group: Callable[[GroupSpec, tuple[ModelTensor, ...]], ModuleGroup]) -> Regrouped:
    """Reconcile `groups` (all offloaded) with `root` as it is now. `specs_for(entries)` is the technique's
    grouping of the current tensors (`entries` = `collect_entries(root)`); `new_group(spec, entries)` builds
    and fills the group of a unit made of new tensors only."""
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
            result.adopted += len(fresh)
        else:
            result.added.append((spec, new_group(spec, fresh)))
    result.emptied = [group for group in groups if not group.entries]
    return result


def _unique_keys(entries: tuple[ModelTensor, ...], group: ModuleGroup) -> tuple[ModelTensor, ...]:
    """`entries`, renamed where a key is already used in `group` (a store is keyed by name; a tensor that left
    and a new one in its place may share one while the old is still held)."""
    used = {entry.key for entry in group.entries}
    renamed = []
    for entry in entries:
        key, suffix = entry.key, 1
        while key in used:
            key, suffix = f"{entry.key}#{suffix}", suffix + 1
        used.add(key)
        renamed.append(entry if key == entry.key else ModelTensor(key=key, slots=entry.slots))
    return tuple(renamed)


__all__ = ["GroupSpec", "OffloadType", "Regrouped", "plan_groups", "regroup", "whole_group"]
