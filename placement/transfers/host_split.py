"""Which host-homed weights of a component are loaded once per call and which stream at every run.

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
loaded per call (`interleave`: each copy then has compute before it to hide behind); a component that runs
once moves the same bytes either way, so it streams every block (the lower peak). Blocks the planned call never runs (`idle`) are
streamed too: they move nothing and take no room in flight (`transfers.idle`).

A component whose blocks may run on several accelerators (`search.spreadable`) may also load blocks per call
onto the others (`away`: the room its phase leaves on each, activations charged there): what the execution
device cannot hold. The last blocks in execution order go first, so the hops between devices stay few; the
rest always comes to the execution device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Sequence

from ..cost import STREAM_BUFFER_BLOCKS, bytes_per_call, stream_buffer
from ..streaming import TransferUnit
from .blocks import is_idle, moved_evenly


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
    streamed = moved_evenly(kept, Counter(unit.bytes for unit in fewest))  # same sizes, spread (`interleave`)
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
    return moved_evenly(blocks, best[1])  # spread between the ones loaded per call (`interleave`)


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
