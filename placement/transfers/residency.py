"""What of a component stays resident, what is loaded once per call and what streams at every run (docs/design.md,
"When it does not fit"): the partial residency the search tries (`fill_resident`), the split of the host-homed
rest (`split_host_part`), and every strategy's plan's transfers (`complete_transfers`). What each choice costs is
`cost`'s; this module only chooses.
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
from ..plan_records import ComponentPlan, ComponentTransfer
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
    # Streamed units streamed onto another accelerator (its own link and stream buffer): path -> accelerator.
    streamed_away: Mapping[str, int] = field(default_factory=dict)

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
        """The streamed blocks in flight at once on the execution device."""
        return stream_buffer(unit.bytes for unit in self.streamed if unit.path not in self.streamed_away)

    def away_buffers(self) -> dict[int, int]:
        """The streamed blocks in flight at once on each other accelerator streamed onto."""
        found: dict[int, list[int]] = {}
        for unit in self.streamed:
            if unit.path in self.streamed_away:
                found.setdefault(self.streamed_away[unit.path], []).append(unit.bytes)
        return {device: stream_buffer(sizes) for device, sizes in found.items()}

    @cached_property
    def phase_weights(self) -> int:
        """Host-homed weights on the execution device at once in the phase: loaded per call + in flight."""
        return self.loaded_bytes - sum(self.away_bytes().values()) + self.buffer_bytes

    def bytes_per_call(self, runs: int) -> int:
        return bytes_per_call(loaded=self.loaded_bytes, streamed=self.streamed_bytes, runs=runs)


def pooled_split(host: Sequence[TransferUnit], *, runs: int, room: Optional[int], onto: int,
                 idle: frozenset[str] = frozenset(), away: Sequence[tuple[int, int]] = (),
                 spread: frozenset[str] = frozenset()) -> Optional[HostSplit]:
    """`split_host_part` with every other streamed block (in execution order) streamed onto the accelerator `onto`
    through its own host link and stream buffer (pooled residency, issue 39), the others onto the execution
    device as before: the two prefetch chains alternate, so two copies are on their way at once; None when that
    cannot be: a streamed block may not leave the execution device, `onto` lacks room for a buffer beside what it
    loads per call, fewer than two blocks stream. Activations hop between the two GPUs around each block moved."""
    if room is None or runs == 1:
        return None
    blocks = [u for u in host if u.block and not is_idle(u.path, idle)]
    reserve = stream_buffer(u.bytes for u in blocks)  # at most what the buffer on `onto` holds
    rooms = dict(away)
    if not blocks or rooms.get(onto, 0) < reserve or not all(is_idle(u.path, spread) for u in blocks):
        return None
    rooms[onto] -= reserve
    split = split_host_part(host, runs=runs, room=room, idle=idle, spread=spread,
                            away=tuple((device, left) for device, left in rooms.items() if left > 0))
    if not split.fits or len(split.streamed) < 2:
        return None
    return replace(split, streamed_away={unit.path: onto for unit in split.streamed[1::2]})


def split_host_part(host: Sequence[TransferUnit], *, runs: int, room: Optional[int],
                    idle: frozenset[str] = frozenset(), away: Sequence[tuple[int, int]] = (),
                    spread: frozenset[str] = frozenset()) -> HostSplit:
    """The per-call / streamed split of `host` (in unit order) moving the fewest bytes per call within `room`
    (None: unlimited) on the execution device and, for the blocks in `spread`, the rooms `away` ((accelerator,
    bytes) pairs) on the others; when even the minimum does not fit, the minimum, `fits=False`.

    The rest is needed for the whole run: always loaded. A component running once moves the same bytes either
    way, so it streams every block (the lower peak); idle blocks stream and move nothing. Streamed blocks are
    spread evenly between the loaded ones (`blocks.moved_evenly`), so each copy has compute to hide behind."""
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
    """Blocks loaded per call onto the other accelerators (path -> accelerator), the last ones in execution order
    first (so the hops between devices stay few), until the home holds the rest (`over`: what loading everything
    there exceeds its room by) or the others are full."""
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
    """The blocks to stream, fewest bytes, adding up to `over` beyond the ones in flight. Each block size is tried
    as the smallest in flight, the rest taken from the sizes no larger, largest first: two sizes (FLUX's double
    and single blocks) stream the small ones when that moves less. Everything when nothing else fits."""
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
                  devices: Sequence[int], spread: Collection[str], in_order: bool = False,
                  reserve_on: Optional[int] = None) -> Filled:
    """Place as many `units` resident as every phase still allows, charge them to `ledger`, and return where.

    The rest first (needed for the whole run), on `home`; then the blocks largest first (the host keeps small
    ones: the blocks in flight take little room), or in execution order (`in_order`, the reference policy's way),
    on `home` or, for those in `spread`, on the other accelerators; one that fits nowhere stays on the host (first
    fit decreasing). On `home` the component's own phase needs its activations and its streaming working set; on
    `reserve_on` (pooled residency, `pooled_split`) its activations and the host blocks' stream buffer."""
    state = _FillState(ledger, name=name, units=units, activation=activation, home=home)
    state.reserve_on = reserve_on
    everywhere = [home, *(d for d in devices if d != home)]
    filled = Filled()
    for unit in (u for u in units if not u.block):  # the rest runs with the inputs: on the home accelerator
        _place_size(state, [unit], [home], filled)
    blocks = [u for u in units if u.block]
    if in_order:
        for unit in blocks:
            _place_size(state, [unit], everywhere if unit.path in spread else [home], filled)
    else:  # the largest blocks first: what stays on the host is small, so the blocks in flight take little room
        for size in sorted({u.bytes for u in blocks}, reverse=True):
            members = [u for u in blocks if u.bytes == size]
            _place_size(state, [u for u in members if u.path not in spread], [home], filled,  # home first:
                        interleave=True)  # no other choice; kept blocks spread between the streamed ones
            _place_size(state, [u for u in members if u.path in spread], everywhere, filled,
                        interleave=len(everywhere) == 1)
    buffer = stream_buffer(u.bytes for u in filled.host if u.block)
    for device, taken in filled.resident.items():
        spans = device != home  # its phase there: its activations (and where it streams onto, its buffer)
        ledger.add(device, weights=sum(u.bytes for u in taken), phase=name,
                   transient=(activation + (buffer if device == reserve_on else 0)) if spans else 0)
    # On its home, the least it now needs (its transfer may load more per call: set with it).
    ledger.set_phase(home, name, activation + minimum_phase_weights(filled.host))
    return filled


def _place_size(state: "_FillState", members: list[TransferUnit], order: Sequence[int], filled: Filled, *,
                interleave: bool = False) -> None:
    """Units of one size: as many as fit on each device in turn (first fit, counted). With `interleave` (one
    device) the kept ones spread evenly between those left on the host (`blocks.kept_evenly`), so each streamed
    block's copy has resident compute before it; across devices, first come, so hops stay few."""
    block = members[0].block if members else True
    for device in order:
        if not members:
            return
        count = state.count_fitting(members[0].bytes, len(members), device, block=block)
        if count:
            state.take(members[0].bytes, count, device, block=block)
            kept = kept_evenly(members, count) if interleave else members[:count]
            filled.resident.setdefault(device, []).extend(kept)
            members = [unit for unit in members if all(unit is not k for k in kept)]
    filled.host.extend(members)


class _FillState:
    """Per device: the room for resident weights and the largest other phase; the component's host part
    (its rest's bytes and its blocks counted by size)."""

    def __init__(self, ledger: Ledger, *, name: str, units: Sequence[TransferUnit], activation: int, home: int):
        self.home, self.activation = home, activation
        self.reserve_on: Optional[int] = None
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
        else:  # where the blocks stream onto (pooled), room kept for them in flight
            own = self.activation + (self._buffer(size, count if block else 0) if device == self.reserve_on else 0)
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
        # Only a split loading blocks per call (a component running several times, with room) or streaming onto
        # another accelerator grows its phases past what the strategy charged, its streaming working set; an untracked device (a dict named it) is left.
        loads_more = split is not None and split.fits and (any(unit.block for unit in split.per_call)
                                                           or bool(split.streamed_away))
        if loads_more and ledger.has(plan.execution_device):
            settle_phases(ledger, request, plan.execution_device, split)
            update["streamed_unit_bytes"] = split.phase_weights
        by_name[name] = replace(placed, plan=plan.model_copy(update=update))
    return replace(state, ledger=ledger, by_name=MappingProxyType(by_name))


def settle_phases(ledger: Ledger, request, home: Device, split: HostSplit) -> None:
    """The component's phase on its execution device (activations, what it loads there, blocks in flight) and
    on each accelerator it loads blocks per call or streams blocks onto (activations, those blocks, its buffer)."""
    ledger.set_phase(home, request.name, request.transient + split.phase_weights)
    loaded, buffers = split.away_bytes(), split.away_buffers()
    for device in {*loaded, *buffers}:
        ledger.set_phase(device, request.name, request.transient + loaded.get(device, 0) + buffers.get(device, 0))


def component_transfers(by_name: Mapping, requests: Mapping, ledger: Ledger,
                        runs: Mapping[str, int]) -> dict[str, ComponentTransfer]:
    """The transfer of each component in `requests` among the placements `by_name` (a name -> Placed mapping)
    under `ledger`: what `cost.CostModel.cost` prices."""
    return {name: component_transfer(by_name[name].plan, request, runs.get(name, 1), ledger)[0]
            for name, request in requests.items()}


def component_transfer(plan: ComponentPlan, request, runs: int,
                       ledger: Ledger) -> tuple[ComponentTransfer, Optional[HostSplit]]:
    """The component's transfer, and its host split (None when nothing host-homed runs on an accelerator) in the
    rooms its phase leaves. Phases are independent once residency is fixed: each component is settled alone."""
    if not is_accelerator(plan.execution_device):
        return ComponentTransfer(runs_per_call=runs), None  # computes on the CPU: nothing crosses to a GPU
    resident = sum(n for device, n in plan.placed_bytes.items() if is_accelerator(device))
    host = host_units(plan.device_map, request)
    if not host:
        return ComponentTransfer(runs_per_call=runs, resident_bytes=resident), None
    home = plan.execution_device
    rooms = dict(room=phase_room(ledger, home, request), idle=request.idle, spread=request.spread_blocks,
                 away=away_rooms(ledger, request, home) if ledger.has(home) else ())
    onto = pooled_onto(plan)
    split = pooled_split(host, runs=runs, onto=onto, **rooms) if onto is not None else None
    if split is None:  # (pooled, when the search chose it and the rooms still allow it)
        split = split_host_part(host, runs=runs, **rooms)
    transfer = ComponentTransfer(
        runs_per_call=runs, resident_bytes=resident, loaded_per_call_bytes=split.loaded_bytes,
        streamed_per_run_bytes=split.streamed_bytes, per_call_modules=[u.path for u in split.per_call],
        streamed_modules=split.streamed_paths, stream_buffer_bytes=split.buffer_bytes,
        per_call_devices=dict(split.away), streamed_devices=dict(split.streamed_away),
    )
    return transfer, split


def pooled_onto(plan: ComponentPlan) -> Optional[int]:
    """The accelerator the search chose to stream `plan`'s blocks onto (pooled residency: it marks the plan's
    transfer, `search._placed`, and the transfer is worked out again here); None when it did not."""
    if plan.transfer is None or not plan.transfer.streamed_devices:
        return None
    return next(iter(plan.transfer.streamed_devices.values()))


def host_units(device_map: Mapping[str, Device], request) -> list[TransferUnit]:
    """The component's units (and pieces of units a finer map, a pinned one, cuts) that `device_map` homes on the
    host."""
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
