"""Partial residency: as many of a component's units resident as the other phases leave room for.

A component that cannot stay whole keeps units resident on its home accelerator (where it executes) and, when
its layout allows a cut across devices, on the others. A unit may go to a device only if every phase there
still fits afterwards: the phases of the components already placed (`Ledger.phase_bytes`), and the
component's own: on its home, its activations, its host-homed rest and two blocks in flight (the least it
needs to run by streaming); elsewhere, its activations (a split charges them to every device it spans).
Units are taken in order -- the rest first (it is needed for the whole run), then the blocks largest first
(so the host keeps small ones: two in flight take little room) -- and one that fits nowhere is skipped for
the smaller ones after it (first fit decreasing). What is not resident
stays on the host; `host_split` then decides what of it is loaded per call and what streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ..devices import Device
from ..memory_model import Ledger
from ..streaming import TransferUnit
from .host_split import STREAM_BUFFER_BLOCKS, minimum_phase_weights


@dataclass(kw_only=True)
class Filled:
    """Where a component's units ended up: resident per device (in unit order), and the host-homed ones."""

    resident: dict[Device, list[TransferUnit]] = field(default_factory=dict)
    host: list[TransferUnit] = field(default_factory=list)

    def resident_bytes(self, device: Device) -> int:
        return sum(unit.bytes for unit in self.resident.get(device, ()))


def fill_resident(ledger: Ledger, *, name: str, units: Sequence[TransferUnit], activation: int, home: int,
                  devices: Sequence[int], spreadable: bool, in_order: bool = False) -> Filled:
    """Place as many `units` resident as fit (see the module doc), charge them to `ledger`, and return where.
    `in_order`: blocks in execution order instead of largest first (the issue's reference policy's way)."""
    state = _FillState(ledger, name=name, units=units, activation=activation, home=home)
    order = [home, *(d for d in devices if d != home)] if spreadable else [home]
    filled = Filled()
    # The rest first, then the largest blocks: what stays on the host is then small blocks, so the two in
    # flight take little room and every run streams fine-grained.
    ranked = sorted(units, key=lambda u: (u.block, 0 if in_order or not u.block else -u.bytes))
    for unit in ranked:
        targets = order if unit.block else [home]  # the rest runs with the inputs: on the home accelerator
        device = next((d for d in targets if state.fits(unit, d)), None)
        if device is None:
            filled.host.append(unit)
            continue
        state.take(unit, device)
        filled.resident.setdefault(device, []).append(unit)
    for device, taken in filled.resident.items():
        spans = device != home  # its phase there: its activations
        ledger.add(device, weights=sum(u.bytes for u in taken), transient=activation if spans else 0, phase=name)
    # On its home, the least it now needs (its transfer may load more per call: set with it).
    ledger.set_phase(home, name, activation + minimum_phase_weights(filled.host))
    return filled


class _FillState:
    """Per device: the room for resident weights and the largest other phase; the component's host part."""

    def __init__(self, ledger: Ledger, *, name: str, units: Sequence[TransferUnit], activation: int, home: int):
        self.home, self.activation = home, activation
        self.limit = {}
        self.others = {}
        self.weights = {}
        for device in ledger.accelerators:
            load = ledger.loads[device]
            self.limit[device] = math.inf if load.budget is None else load.budget - ledger.overhead(device)
            self.others[device] = ledger.phase_bytes(device, excluding=name)
            self.weights[device] = load.weights
        self.host_rest = sum(u.bytes for u in units if not u.block)
        self.host_blocks = sorted((u.bytes for u in units if u.block), reverse=True)

    def _home_need(self, unit: TransferUnit) -> int:
        """The component's phase on its home once `unit` is resident: activations, host rest, two blocks."""
        rest = self.host_rest - (0 if unit.block else unit.bytes)
        top = self.host_blocks[: STREAM_BUFFER_BLOCKS + 1]  # a copy: the largest three host blocks
        if unit.block and unit.bytes in top:
            top.remove(unit.bytes)
        return self.activation + rest + sum(top[:STREAM_BUFFER_BLOCKS])

    def fits(self, unit: TransferUnit, device: int) -> bool:
        own = self._home_need(unit) if device == self.home else self.activation
        return self.weights[device] + unit.bytes + max(self.others[device], own) <= self.limit[device]

    def take(self, unit: TransferUnit, device: int) -> None:
        self.weights[device] += unit.bytes
        if unit.block:
            self.host_blocks.remove(unit.bytes)
        else:
            self.host_rest -= unit.bytes
