"""Keep a module's offload groups in step with the module after it was edited in place.

An adapter loaded into an offloaded module (peft wraps a layer and adds its matrices beside it), fused into its
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

from torch import nn

from .grouping import GroupSpec
from .module_group import ModuleGroup
from ..tensor_slots import ModelTensor, collect_entries


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


__all__ = ["Regrouped", "regroup"]
