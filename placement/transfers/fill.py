"""Partial residency: as many of a component's units resident as the other phases leave room for.

A component that cannot stay whole keeps units resident on its home accelerator (where it executes) and, for
the blocks its layout allows to cut across devices (`rooms.spread_blocks`), on the others. A unit may go to a
device only if every phase there still fits afterwards: the phases of the components already placed
(`Ledger.phase_bytes`), and the component's own: on its home, its activations and its host-homed working set
(`cost.minimum_phase_weights`: the rest and the blocks in flight, the least it needs to run by streaming);
elsewhere, its activations (a split charges them to every device it spans). Units are taken in order -- the
rest first (it is needed for the whole run), then the blocks largest first (so the host keeps small ones: the
blocks in flight take little room) -- and one that fits nowhere is skipped for the smaller ones after it (first
fit decreasing). The blocks of one size kept on the home are spread evenly between those left on the host
(`interleave`), so every streamed block has resident compute before it. What is not resident stays on the host;
`host_split` then decides what of it is loaded per call and what streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Sequence

from ..cost import minimum_phase_weights, stream_buffer_by_size
from ..devices import Device
from ..memory_model import Ledger
from ..streaming import TransferUnit
from .blocks import kept_evenly


@dataclass(kw_only=True)
class Filled:
    """Where a component's units ended up: resident per device (in unit order), and the host-homed ones."""

    resident: dict[Device, list[TransferUnit]] = field(default_factory=dict)
    host: list[TransferUnit] = field(default_factory=list)

    def resident_bytes(self, device: Device) -> int:
        return sum(unit.bytes for unit in self.resident.get(device, ()))


def fill_resident(ledger: Ledger, *, name: str, units: Sequence[TransferUnit], activation: int, home: int,
                  devices: Sequence[int], spread: Collection[str], in_order: bool = False) -> Filled:
    """Place as many `units` resident as fit (see the module doc), charge them to `ledger`, and return where.
    `spread`: the blocks that may sit on other accelerators than `home` (the others stay there or on the host).
    `in_order`: blocks in execution order instead of largest first (the reference policy's way)."""
    state = _FillState(ledger, name=name, units=units, activation=activation, home=home)
    everywhere = [home, *(d for d in devices if d != home)]
    filled = Filled()
    for unit in (u for u in units if not u.block):  # the rest runs with the inputs: on the home accelerator
        _place_one(state, unit, [home], filled)
    blocks = [u for u in units if u.block]
    if in_order:
        for unit in blocks:
            _place_one(state, unit, everywhere if unit.path in spread else [home], filled)
    else:  # the largest blocks first: what stays on the host is small, so the blocks in flight take little room
        for size in sorted({u.bytes for u in blocks}, reverse=True):
            members = [u for u in blocks if u.bytes == size]
            _place_size(state, [u for u in members if u.path not in spread], [home], filled,  # home first:
                        interleave=True)  # no other choice; kept blocks spread between the streamed ones
            _place_size(state, [u for u in members if u.path in spread], everywhere, filled,
                        interleave=len(everywhere) == 1)
    for device, taken in filled.resident.items():
        spans = device != home  # its phase there: its activations
        ledger.add(device, weights=sum(u.bytes for u in taken), transient=activation if spans else 0, phase=name)
    # On its home, the least it now needs (its transfer may load more per call: set with it).
    ledger.set_phase(home, name, activation + minimum_phase_weights(filled.host))
    return filled


def _place_one(state: "_FillState", unit: TransferUnit, order: Sequence[int], filled: Filled) -> None:
    device = next((d for d in order if state.count_fitting(unit.bytes, 1, d, block=unit.block)), None)
    if device is None:
        filled.host.append(unit)
        return
    state.take(unit.bytes, 1, device, block=unit.block)
    filled.resident.setdefault(device, []).append(unit)


def _place_size(state: "_FillState", members: list[TransferUnit], order: Sequence[int], filled: Filled, *,
                interleave: bool = False) -> None:
    """Blocks of one size: as many as fit on each device in turn (first fit, counted rather than tried). With
    `interleave` (one device), the kept ones spread evenly between those left on the host (`interleave`), so
    each streamed block's copy has resident compute before it; across devices, first come, so hops stay few."""
    for device in order:
        if not members:
            return
        count = state.count_fitting(members[0].bytes, len(members), device, block=True)
        if count:
            state.take(members[0].bytes, count, device, block=True)
            kept = kept_evenly(members, count) if interleave else members[:count]
            filled.resident.setdefault(device, []).extend(kept)
            members = [unit for unit in members if all(unit is not k for k in kept)]
    filled.host.extend(members)


class _FillState:
    """Per device: the room for resident weights and the largest other phase; the component's host part
    (its rest's bytes and its blocks counted by size)."""

    def __init__(self, ledger: Ledger, *, name: str, units: Sequence[TransferUnit], activation: int, home: int):
        self.home, self.activation = home, activation
        self.limit, self.others, self.weights = {}, {}, {}
        for device in ledger.accelerators:
            load = ledger.loads[device]
            self.limit[device] = math.inf if load.budget is None else load.budget - ledger.overhead(device)
            self.others[device] = ledger.phase_bytes(device, excluding=name)
            self.weights[device] = load.weights
        self.host_rest = sum(u.bytes for u in units if not u.block)
        self.counts: dict[int, int] = {}
        for unit in units:
            if unit.block:
                self.counts[unit.bytes] = self.counts.get(unit.bytes, 0) + 1

    def _buffer(self, size: int, taken: int) -> int:
        """The host blocks' stream buffer once `taken` blocks of `size` are resident."""
        if not taken:
            return stream_buffer_by_size(self.counts)
        return stream_buffer_by_size({**self.counts, size: self.counts[size] - taken})

    def _fits(self, size: int, count: int, device: int, *, block: bool) -> bool:
        if device == self.home:
            rest = self.host_rest - (0 if block else size * count)
            own = self.activation + rest + self._buffer(size, count if block else 0)
        else:
            own = self.activation
        return self.weights[device] + size * count + max(self.others[device], own) <= self.limit[device]

    def count_fitting(self, size: int, most: int, device: int, *, block: bool) -> int:
        """How many of `most` units of `size` can go to `device` together (0 when none)."""
        room = self.limit[device] - self.weights[device] - max(self.others[device], self.activation)
        upper = min(most, int(room // size) if size and room != math.inf else most)
        for count in range(upper, 0, -1):  # the home's own need shrinks as blocks leave the host: check each
            if self._fits(size, count, device, block=block):
                return count
        return 0

    def take(self, size: int, count: int, device: int, *, block: bool) -> None:
        self.weights[device] += size * count
        if block:
            self.counts[size] -= count
        else:
            self.host_rest -= size * count
