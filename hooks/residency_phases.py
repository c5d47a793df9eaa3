"""Who holds what on each accelerator between a pipeline's phases: per-call residency's bookkeeping.

A component's runs are its phase (`ComponentPhase`); on each accelerator it uses it has a `DeviceShare` (its
per-call units there and what its runs need besides weights). One `DeviceCoordinator` per accelerator: when a
phase starts, it releases the per-call units of the components that ran longest ago, last unit first, until the
arriving share fits in `room`; then the phase loads its per-call units on every device at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from placement.cost import working_set
from placement.devices import Device

from .group_offload.module_group import ModuleGroup, onload_together
from .group_offload.offload import GroupOffloadSession


class DeviceCoordinator:
    """The shares of the components that use one accelerator; `room`: bytes for per-call units, the running
    component's activations and stream buffers (None: unlimited)."""

    def __init__(self, *, place: Device, room: int | None) -> None:
        self.place = place
        self.room = room
        self.phases: list[DeviceShare] = []
        self._clock = 0

    def __repr__(self) -> str:
        return f"DeviceCoordinator(place={self.place!r}, room={self.room}, phases={[p.name for p in self.phases]})"

    def make_room(self, share: DeviceShare) -> None:
        """`share`'s phase starts: release the idle shares' per-call units it needs the room of."""
        self._clock += 1
        share.last_entered = self._clock
        if self.room is None:
            return
        allowed = self.room - share.transient_bytes - share.per_call_bytes
        excess = sum(other.loaded_bytes for other in self.phases if other is not share) - allowed
        idle = sorted((p for p in self.phases if p is not share and not p.phase.active), key=lambda p: p.last_entered)
        for other in idle:
            if excess <= 0:
                break
            excess -= other.release(excess)


class DeviceShare:
    """One component's part of one accelerator; byte counts are read from the units at each phase start, so a
    regroup after an edit is followed."""

    def __init__(self, *, phase: ComponentPhase, coordinator: DeviceCoordinator, per_call: list[ModuleGroup]) -> None:
        self.phase = phase
        self.coordinator = coordinator
        self.per_call = per_call
        self.last_entered = 0

    def __repr__(self) -> str:
        return f"DeviceShare({self.name!r} on {self.coordinator.place!r}, {self.per_call_bytes} per call)"

    @property
    def name(self) -> str:
        return self.phase.name

    @property
    def per_call_bytes(self) -> int:
        return sum(group.num_bytes for group in self.per_call)

    @property
    def transient_bytes(self) -> int:
        return self.phase.activation_bytes + self.phase.stream_buffer_bytes_on(self.coordinator.place)

    @property
    def loaded_bytes(self) -> int:
        return sum(group.num_bytes for group in self.per_call if group.is_onloaded)

    def release(self, needed: int) -> int:
        """Offload per-call units, last first, until `needed` bytes are free; returns the bytes freed."""
        freed = 0
        for group in reversed(self.per_call):
            if freed >= needed:
                break
            if group.is_onloaded:
                group.offload()
                freed += group.num_bytes
        return freed


class ComponentPhase:
    """One component's shares, per-run units and streamed sessions (one per accelerator it streams onto: each GPU
    prefetches its own span's blocks through its own buffers); `enter`/`exit` nest."""

    def __init__(self, *, name: str, place: Device, per_run: list[ModuleGroup],
                 sessions: Mapping[Device, GroupOffloadSession] | None = None, activation_bytes: int = 0,
                 config=None) -> None:
        self.name = name
        self.config = config  # what it was applied with (an edit regroups its units by the same lists)
        self.place = place  # its execution device
        self.activation_bytes = activation_bytes  # what its runs need besides weights, on every device it uses
        self.per_run = per_run  # streamed units needed through a whole run (the rest of a streamed module)
        self.sessions: dict[Device, GroupOffloadSession] = dict(sessions or {})
        self.shares: dict[Device, DeviceShare] = {}
        self.depth = 0
        # Torch hooks that start and end a run (also when the forward raised), not the accelerate hook's
        # pre_forward, which an entry method (diffusers' `apply_forward_hook`) runs by hand with no end to pair it.
        self.run_hooks: list = []

    def share(self, coordinators: Mapping[Device, DeviceCoordinator], place: Device,
              per_call: list[ModuleGroup]) -> None:
        """Take a share of `place` (its coordinator in `coordinators`, else an unlimited one of its own)."""
        coordinator = coordinators.get(place) or DeviceCoordinator(place=place, room=None)
        self.shares[place] = DeviceShare(phase=self, coordinator=coordinator, per_call=per_call)

    def join(self) -> None:
        for share in self.shares.values():
            share.coordinator.phases.append(share)

    @property
    def active(self) -> bool:
        return self.depth > 0

    @property
    def per_call(self) -> list[ModuleGroup]:
        return [group for share in self.shares.values() for group in share.per_call]

    @property
    def loaded_bytes(self) -> int:
        return sum(share.loaded_bytes for share in self.shares.values())

    @property
    def stream_buffer_bytes(self) -> int:
        """What streaming keeps on the execution device at once, as the planner counts it (`cost.working_set`)."""
        return self.stream_buffer_bytes_on(self.place)

    def stream_buffer_bytes_on(self, place: Device) -> int:
        """What streaming keeps on `place` at once: each GPU streams the blocks of its own span through its own
        buffers (pooled residency); the rest streamed per run goes to the execution device."""
        blocks = self.sessions[place].groups if place in self.sessions else []
        rest = sum(group.num_bytes for group in self.per_run if group.onload_place == place)
        return working_set(rest, (group.num_bytes for group in blocks))

    def enter(self) -> None:
        self.depth += 1
        if self.depth == 1:
            for share in self.shares.values():
                share.coordinator.make_room(share)
            onload_together(self.per_call)  # every device's copies started before any is waited for
            onload_together(self.per_run)
            for session in self.sessions.values():  # each GPU's first streamed block is sent now
                session.begin_call()

    def exit(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            for session in self.sessions.values():
                session.end_call()
            for group in self.per_run:
                group.offload()

    def close(self) -> None:
        """Every unit back where the loader put it (disk weights: on the CPU); coordinators forget it."""
        for handle in self.run_hooks:
            handle.remove()
        self.run_hooks = []
        for share in self.shares.values():
            if share in share.coordinator.phases:
                share.coordinator.phases.remove(share)
        for group in [*self.per_call, *self.per_run]:
            group.restore()
        for session in self.sessions.values():
            session.close()


__all__ = ["ComponentPhase", "DeviceCoordinator", "DeviceShare"]
