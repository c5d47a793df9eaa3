"""What of a component stays resident on accelerators, what is loaded once per call and what streams at every run:
the partial residency the placement search tries (`fill_resident`), the split of the host-homed rest
(`split_host_part`), and every component's transfer for any strategy's plan (`complete_transfers`).

Partial residency keeps as many of a component's units resident as the other phases leave room for. A component
that cannot stay whole keeps units resident on its home accelerator (where it executes) and, for the blocks its
layout allows to cut across devices (`blocks.spread_blocks`), on the others. A unit may go to a device only if
every phase there still fits afterwards: the phases of the components already placed (`Ledger.phase_bytes`), and
the component's own: on its home, its activations and its host-homed working set (`cost.minimum_phase_weights`: the
rest and the blocks in flight, the least it needs to run by streaming); elsewhere, its activations (a split charges
them to every device it spans). Units are taken in order -- the rest first (it is needed for the whole run), then
the blocks largest first (so the host keeps small ones: the blocks in flight take little room) -- and one that fits
nowhere is skipped for the smaller ones after it (first fit decreasing). The blocks of one size kept on the home
are spread evenly between those left on the host (`blocks.kept_evenly`), so every streamed block has resident
compute before it. What is not resident stays on the host; `split_host_part` then decides what of it is loaded per
call and what streams.

A component whose weights are partly or wholly homed in CPU RAM (or on disk) and that executes on an
accelerator brings them there in its phase. Two ways (docs/design.md, "When it does not fit"):
- loaded per call: moved when its phase starts, kept through its `runs` runs (a denoiser's steps), released
  after: one copy per call, but all of it on the device at once;
- streamed: block by block at every run, the next block prefetched while one computes: `runs` copies per call,
  but only the blocks in flight on the device at once (`cost.stream_buffer`).
What each costs, in bytes per call and in room, is `cost`'s; this module only chooses.
The rest (everything outside the blocks) is needed for the whole run, so it is never streamed: it is loaded
per call. With `room` bytes free in the phase (after the resident weights, the activations and the overhead),
the split that moves the fewest bytes per call is chosen, its streamed blocks spread evenly between the ones
loaded per call (`blocks.moved_evenly`: each copy then has compute before it to hide behind); a component that runs
once moves the same bytes either way, so it streams every block (the lower peak). Blocks the planned call never runs
(`blocks.is_idle`) are streamed too: they move nothing and take no room in flight.

A component whose blocks may run on several accelerators (`blocks.spreadable`) may also load blocks per call onto
the others (`away`: the room its phase leaves on each, activations charged there): what the execution device cannot
hold. The last blocks in execution order go first, so the hops between devices stay few; the rest always comes to
the execution device.

Every component's transfer (`ComponentPlan.transfer`) comes from where its weights live, for any strategy.
Residency is what the strategy decided: the device-map entries naming an accelerator. The host-homed rest of a
component executing on an accelerator is split into loaded-per-call and streamed units (`split_host_part`) within
the room its own phase leaves on its execution device: the budget, less the overhead, the resident weights there
(everyone's: they stay in every phase) and its activations. Phases are independent once residency is fixed (one
component runs at a time), so each component is settled on its own. A component that loads blocks per call has its
phase in the ledger set to what it then holds (activations + loaded per call + blocks in flight); one that streams
every block keeps what its strategy charged (its streaming working set; at model scope accelerate's one module at a
time, which its hooks run with).

Host-homed units are read through the device map at module granularity (`streaming.transfer_units`); a map that
cuts finer than a unit (a pinned `{submodule: device}` map) is followed key by key inside it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Collection, Mapping, Optional, Sequence

from ..cost import STREAM_BUFFER_BLOCKS, bytes_per_call, minimum_phase_weights, stream_buffer, stream_buffer_by_size
from ..device_maps import owning_key
from ..devices import Device, is_accelerator
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan, ComponentTransfer
from ..streaming import TransferUnit
from .blocks import away_rooms, is_idle, kept_evenly, moved_evenly, phase_room


@dataclass(frozen=True, kw_only=True)
class HostSplit:
    """The host-homed units of one component, split into loaded-per-call and streamed ones."""

    per_call: tuple[TransferUnit, ...]
    streamed: tuple[TransferUnit, ...]
    fits: bool = True  # False: even the minimum (the rest + the blocks in flight) exceeds the room given
    idle: tuple[TransferUnit, ...] = ()  # streamed, but never run by the planned call: nothing moves
    # Per-call units loaded onto another accelerator than the execution device: path -> accelerator.
    away: Mapping[str, int] = field(default_factory=dict)

    def away_bytes(self) -> dict[int, int]:
        """Per-call bytes loaded onto each other accelerator."""
        found: dict[int, int] = {}
        for unit in self.per_call:
            if unit.path in self.away:
                found[self.away[unit.path]] = found.get(self.away[unit.path], 0) + unit.bytes
        return found

    @property
    def streamed_paths(self) -> list[str]:
        """Every streamed unit's path, the idle ones' included (the runtime hooks them all)."""
        return [unit.path for unit in (*self.streamed, *self.idle)]

    @cached_property
    def loaded_bytes(self) -> int:
        return sum(unit.bytes for unit in self.per_call)

    @cached_property
    def streamed_bytes(self) -> int:
        return sum(unit.bytes for unit in self.streamed)

    @cached_property
    def buffer_bytes(self) -> int:
        """The streamed blocks in flight at once."""
        return stream_buffer(unit.bytes for unit in self.streamed)

    @cached_property
    def phase_weights(self) -> int:
        """Host-homed weights on the execution device at once in the phase: loaded per call + in flight."""
        return self.loaded_bytes - sum(self.away_bytes().values()) + self.buffer_bytes

    def bytes_per_call(self, runs: int) -> int:
        return bytes_per_call(loaded=self.loaded_bytes, streamed=self.streamed_bytes, runs=runs)


def split_host_part(host: Sequence[TransferUnit], *, runs: int, room: Optional[int],
                    idle: frozenset[str] = frozenset(), away: Sequence[tuple[int, int]] = (),
                    spread: frozenset[str] = frozenset()) -> HostSplit:
    """The per-call / streamed split of `host` (in unit order) moving the fewest bytes per call within `room`
    (None: unlimited) on the execution device and the rooms `away` ((accelerator, bytes) pairs, may be empty)
    on the others, for the blocks in `spread` (paths); the blocks in `idle` stream and move nothing. When even the minimum does not fit,
    the minimum, marked `fits=False`."""
    unused = tuple(u for u in host if u.block and is_idle(u.path, idle))
    if unused:
        host = [u for u in host if not (u.block and is_idle(u.path, idle))]
    rest = tuple(u for u in host if not u.block)
    blocks = tuple(u for u in host if u.block)
    minimum = HostSplit(per_call=rest, streamed=blocks, idle=unused)
    if room is not None and minimum.phase_weights > room:
        return HostSplit(per_call=rest, streamed=blocks, fits=False, idle=unused)
    if runs == 1 or not blocks:
        return minimum  # the same bytes per call either way: the lower peak
    if room is None or sum(u.bytes for u in host) <= room:
        return HostSplit(per_call=tuple(host), streamed=(), idle=unused)
    movable = [u for u in blocks if is_idle(u.path, spread)]  # (inside one of those blocks)
    sent = _send_away(movable, over=sum(u.bytes for u in host) - room, away=away)
    kept = tuple(u for u in blocks if u.path not in sent)
    if minimum.loaded_bytes + sum(u.bytes for u in kept) <= room:
        return HostSplit(per_call=tuple(host), streamed=(), idle=unused, away=sent)
    over = minimum.loaded_bytes + sum(b.bytes for b in kept) - room
    candidates = [_fewest_streamed(kept, over=over), _in_order(kept, room=room - minimum.loaded_bytes)]
    fewest = min(candidates, key=lambda chosen: sum(u.bytes for u in chosen))
    streamed = moved_evenly(kept, Counter(unit.bytes for unit in fewest))  # same sizes, spread (`blocks.moved_evenly`)
    chosen = {id(unit) for unit in streamed}
    return HostSplit(per_call=tuple(u for u in host if id(u) not in chosen),
                     streamed=tuple(u for u in kept if id(u) in chosen), idle=unused, away=sent)


def _send_away(blocks: Sequence[TransferUnit], *, over: int, away: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Blocks loaded per call onto the other accelerators (path -> accelerator): the last ones in execution order
    first, each onto the first accelerator with room, until the execution device holds the rest (`over`: what
    loading everything there exceeds its room by) or no other accelerator has room left."""
    left = {device: room for device, room in away if room > 0}
    sent: dict[str, int] = {}
    for unit in reversed(blocks):
        if over <= 0 or not left:
            break
        device = next((d for d, room in left.items() if unit.bytes <= room), None)
        if device is None:
            continue
        sent[unit.path] = device
        left[device] -= unit.bytes
        over -= unit.bytes
    return sent


def _in_order(blocks: Sequence[TransferUnit], *, room: int) -> list[TransferUnit]:
    """The reference policy's split: room kept for the largest blocks in flight, the blocks that fit in what is
    left loaded per call (execution order, first fit), the others streamed."""
    left = room - stream_buffer(u.bytes for u in blocks)
    streamed = []
    for unit in blocks:
        if unit.bytes <= left:
            left -= unit.bytes
        else:
            streamed.append(unit)
    return streamed


def _fewest_streamed(blocks: Sequence[TransferUnit], *, over: int) -> list[TransferUnit]:
    """The blocks to stream, fewest bytes: beyond the ones in flight (the largest streamed ones), the streamed
    blocks must add up to `over` (what loading everything per call exceeds the room by).

    For each block size as the smallest in flight (the others as small as the blocks allow), the kept-out blocks
    are taken from the sizes no larger, largest first; the cheapest choice wins. Blocks of one size (most
    models) give the obvious answer; two sizes (FLUX's double and single blocks) stream the small ones with
    small ones in flight when that moves less. Everything when nothing else fits."""
    sizes = sorted({unit.bytes for unit in blocks})
    counts = {size: sum(1 for unit in blocks if unit.bytes == size) for size in sizes}
    best = None
    for index in range(len(sizes)):
        flight = _in_flight(counts, sizes[index:])
        if flight is None:
            continue
        taken = _cover(over, {size: counts[size] - flight.get(size, 0) for size in sizes[: index + 1]})
        if taken is None:
            continue
        total = sum(size * n for size, n in (*flight.items(), *taken.items()))
        if best is None or total < best[0]:
            wanted = dict(taken)
            for size, n in flight.items():
                wanted[size] = wanted.get(size, 0) + n
            best = (total, wanted)
    if best is None:
        return list(blocks)
    return moved_evenly(blocks, best[1])  # spread between the ones loaded per call (`blocks.moved_evenly`)


def _in_flight(counts: dict[int, int], sizes: Sequence[int]) -> dict[int, int] | None:
    """The smallest blocks in flight drawn from `sizes` (ascending, the first one included): size -> how many;
    None when they hold too few blocks to fill the stream buffer."""
    flight, need = {}, STREAM_BUFFER_BLOCKS
    for size in sizes:
        flight[size] = min(counts[size], need)
        need -= flight[size]
        if not need:
            return flight
    return None


def _cover(over: int, available: dict[int, int]) -> dict[int, int] | None:
    """How many blocks of each size (largest first) add up to at least `over`; None when they cannot."""
    taken, total = {}, 0
    for size in sorted(available, reverse=True):
        if total >= over:
            break
        count = min(available[size], -(-(over - total) // size))
        taken[size] = count
        total += count * size
    return taken if total >= over else None


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
    `interleave` (one device), the kept ones spread evenly between those left on the host (`blocks.kept_evenly`),
    so each streamed block's copy has resident compute before it; across devices, first come, so hops stay few."""
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


def complete_transfers(state, requests: Mapping, runs: Mapping[str, int]):
    """`state` (a `strategies.PlacementState`) with every component's transfer filled and its phase settled."""
    ledger = state.ledger.copy()
    by_name = {}
    for name, placed in state.by_name.items():
        plan = placed.plan
        request = requests[name]
        transfer, split = component_transfer(plan, request, runs.get(name, 1), ledger)
        update: dict = {"transfer": transfer}
        if _loads_more(split) and ledger.has(plan.execution_device):  # untracked: a dict named a device
            settle_phases(ledger, request, plan.execution_device, split)
            update["streamed_unit_bytes"] = split.phase_weights
        by_name[name] = replace(placed, plan=plan.model_copy(update=update))
    return replace(state, ledger=ledger, by_name=MappingProxyType(by_name))


def settle_phases(ledger: Ledger, request, home: Device, split: HostSplit) -> None:
    """The component's phase on its execution device (activations, what it loads there, blocks in flight) and
    on each accelerator it loads blocks per call onto (activations and those blocks)."""
    ledger.set_phase(home, request.name, request.transient + split.phase_weights)
    for device, loaded in split.away_bytes().items():
        ledger.set_phase(device, request.name, request.transient + loaded)


def _loads_more(split: Optional[HostSplit]) -> bool:
    """Whether the split loads more per call than streaming needs (a component running several times, with
    room): only then does its phase grow past what the strategy charged, its streaming working set."""
    if split is None or not split.fits:
        return False
    return any(unit.block for unit in split.per_call)


def component_transfers(by_name: Mapping, requests: Mapping, ledger: Ledger,
                        runs: Mapping[str, int]) -> dict[str, ComponentTransfer]:
    """The transfer of each component in `requests` among the placements `by_name` (a name -> Placed mapping)
    under `ledger`: what `cost.CostModel.cost` prices."""
    return {name: component_transfer(by_name[name].plan, request, runs.get(name, 1), ledger)[0]
            for name, request in requests.items()}


def component_transfer(plan: ComponentPlan, request, runs: int,
                       ledger: Ledger) -> tuple[ComponentTransfer, Optional[HostSplit]]:
    """The component's transfer, and its host split (None when nothing host-homed runs on an accelerator),
    within the room its phase leaves (`phase_room`, `away_rooms`: on its execution device and, spread, on the
    others)."""
    if not is_accelerator(plan.execution_device):
        return ComponentTransfer(runs_per_call=runs), None  # computes on the CPU: nothing crosses to a GPU
    resident = sum(n for device, n in plan.placed_bytes.items() if is_accelerator(device))
    host = host_units(plan.device_map, request)
    if not host:
        return ComponentTransfer(runs_per_call=runs, resident_bytes=resident), None
    home = plan.execution_device
    split = split_host_part(host, runs=runs, room=phase_room(ledger, home, request), idle=request.idle,
                            away=away_rooms(ledger, request, home) if ledger.has(home) else (),
                            spread=request.spread_blocks)
    transfer = ComponentTransfer(
        runs_per_call=runs, resident_bytes=resident, loaded_per_call_bytes=split.loaded_bytes,
        streamed_per_run_bytes=split.streamed_bytes, per_call_modules=[u.path for u in split.per_call],
        streamed_modules=split.streamed_paths, stream_buffer_bytes=split.buffer_bytes,
        per_call_devices=dict(split.away),
    )
    return transfer, split


def host_units(device_map: Mapping[str, Device], request) -> list[TransferUnit]:
    """The component's units (and pieces of units a finer map cuts) that `device_map` homes on the host."""
    if all(is_accelerator(device) for device in device_map.values()):
        return []
    keys = tuple(device_map)
    sizes = request.size.module_sizes
    found: list[TransferUnit] = []
    for unit in request.layout_units:
        owner = owning_key(unit.path, keys)
        _pieces(unit, None if owner is None else device_map[owner], device_map, keys, sizes, found)
    return found


def _pieces(unit: TransferUnit, owner: Optional[Device], device_map, keys, sizes, found: list) -> None:
    """The host-homed pieces of `unit`: keys strictly inside it are followed (recursively); what they leave
    belongs to the key that owns the unit."""
    inside = [key for key in keys if _strictly_inside(key, unit.path)]
    outermost = [key for key in inside if not any(_strictly_inside(key, other) for other in inside)]
    covered = 0
    for key in outermost:
        piece = TransferUnit(path=key, bytes=sizes.get(key, 0), block=unit.block)
        covered += piece.bytes
        _pieces(piece, device_map[key], device_map, keys, sizes, found)
    remaining = unit.bytes - covered
    if remaining > 0 and owner is not None and not is_accelerator(owner):
        found.append(TransferUnit(path=unit.path, bytes=remaining, block=unit.block))


def _strictly_inside(key: str, path: str) -> bool:
    if key == path:
        return False
    return key.startswith(f"{path}.") if path else bool(key)
