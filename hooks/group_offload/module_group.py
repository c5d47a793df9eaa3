"""A group of modules whose weights are onloaded together before use and offloaded together after it.

Each onload is counted by the transfer meter: the group's bytes, from its store (host RAM or disk) to the
place it onloads to (the plan's spelling of the onload device: under virtual accelerators the torch device
is the CPU, the place says it is an accelerator).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch
from torch import nn

from placement.devices import Device

from .storage import CheckpointStore, DiskStore, HostStore
from .transfer import BlockingTransfer, PendingCopy, StreamTransfer
from .. import trace
from .. import transfer_meter as meter
from ..tensor_slots import ModelTensor


class GroupState(Enum):
    OFFLOADED = "offloaded"  # weights in the store; the module holds the store's form (host tensor or meta)
    ONLOADED = "onloaded"  # weights on the onload device (possibly still being copied on a side stream)
    PLAIN = "plain"  # not (or no longer) offloaded: plain weights where they were, the group is inert


class ReleaseRule(Enum):
    """When a group goes back to its store."""

    AFTER_LAST_MODULE = "after_last_module"  # a run of blocks: after the last block of the run returns
    WHEN_IDLE = "when_idle"  # everything else: when no module of the group is running any more


class ModuleGroup:
    """Onloads/offloads `entries` as one unit; `modules` are the modules whose calls drive it, in order."""

    def __init__(
        self,
        *,
        name: str,
        modules: Sequence[nn.Module],
        entries: Sequence[ModelTensor],
        release: ReleaseRule,
        onload_device: torch.device,
        store: HostStore | DiskStore | CheckpointStore,
        transfer: BlockingTransfer | StreamTransfer,
        onload_place: Device | None = None,
    ) -> None:
        self.name = name
        self.modules = tuple(modules)
        self.entries = tuple(entries)
        self.release = release
        self.onload_device = onload_device
        self.onload_place = meter.place_of_device(onload_device) if onload_place is None else onload_place
        self.store = store
        self.transfer = transfer
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)
        self.original_devices = {entry.key: entry.get().device for entry in self.entries}
        self.state = GroupState.PLAIN  # until `take_weights` hands the weights to the store
        self.active_calls = 0
        self._unused = False  # onloaded and not used yet
        self._pending: PendingCopy | None = None

    def __repr__(self) -> str:
        return f"ModuleGroup({self.name!r}, {len(self.entries)} tensors, {self.num_bytes} bytes, {self.state.value})"

    @property
    def is_onloaded(self) -> bool:
        return self.state is GroupState.ONLOADED

    def take_weights(self) -> None:
        """Hand the weights to the store (once, when the technique is applied)."""
        self.store.take(self.entries)
        self.state = GroupState.OFFLOADED

    def onload(self) -> bool:
        """Start bringing the weights to the onload device; True when this call started it."""
        if self.state is not GroupState.OFFLOADED:
            return False
        sources = self.store.read(pinned=self.transfer.uses_pinned_memory, device=self.onload_device)
        side = getattr(self.transfer, "stream", None)  # a CUDA side stream times the copy itself
        trace.copy_issued(self, self.onload_device, side)
        self._pending = self.transfer.copy(sources, self.onload_device)
        trace.copy_done(self, self.onload_device, side)
        meter.record(meter.Payload.WEIGHTS, self.num_bytes, source=self.store.home, target=self.onload_place)
        for entry in self.entries:
            entry.set(self._pending.tensors[entry.key])
        self.state = GroupState.ONLOADED
        self._unused = True
        return True

    def wait_until_ready(self) -> None:
        """Make the current stream wait for the copy (no-op for blocking copies)."""
        if self._pending is not None:
            self.transfer.wait(self._pending)
            self._pending = None

    def enter(self) -> bool:
        """A module of the group is about to run: count it, onload if needed.

        True for the first use since the weights came (onloaded here or prefetched before): the moment to
        prefetch the next group, once per visit rather than once per module of the group.
        """
        self.active_calls += 1
        self.onload()
        first_use, self._unused = self._unused, False
        return first_use

    def leave(self, module: nn.Module) -> None:
        """A module of the group returned: offload when the release rule says the group is done."""
        self.active_calls = max(0, self.active_calls - 1)
        if self.release is ReleaseRule.AFTER_LAST_MODULE:
            done = module is self.modules[-1]
        else:
            done = self.active_calls == 0
        if done:
            self.offload()

    def offload(self) -> None:
        if self.state is not GroupState.ONLOADED:
            return
        self.wait_until_ready()
        self.store.release(self.entries)
        self.state = GroupState.OFFLOADED

    def reset(self) -> None:
        """Forget running calls (a previous call may have raised between pre- and post-forward) and offload."""
        self.active_calls = 0
        self.offload()

    def adopt(self, entries: Sequence[ModelTensor]) -> None:
        """Make `entries` (tensors added to the module, e.g. an adapter's, while the group was offloaded) part
        of the group: the store takes them, and from now on they move with the group's other weights."""
        self.offload()
        for entry in entries:
            self.original_devices[entry.key] = entry.get().device
        self.store.take(entries)
        self.entries += tuple(entries)
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def forget(self, entries: Sequence[ModelTensor]) -> None:
        """Drop `entries` (tensors no longer in the module, e.g. an unloaded adapter's) from the group."""
        keys = {entry.key for entry in entries}
        self.store.forget(keys)
        self.entries = tuple(entry for entry in self.entries if entry.key not in keys)
        for key in keys:
            self.original_devices.pop(key, None)
        self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def store_edits(self) -> None:
        """Re-store the entries whose tensor was replaced while the group was offloaded (`param.data = fused`
        leaves the store holding the old data; an in-place write changed the stored tensor itself)."""
        changed = [entry for entry in self.entries if not self.store.holds(entry)]
        if changed:
            self.store.take(changed)
            self.num_bytes = sum(entry.num_bytes for entry in self.entries)

    def restore(self) -> None:
        """Undo the technique for this group: plain weights back on their original devices (idempotent)."""
        if self.state is GroupState.PLAIN:
            return
        self.wait_until_ready()
        self.store.restore(self.entries, self.original_devices)
        self.state = GroupState.PLAIN
