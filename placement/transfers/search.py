"""The residency search: among plans that execute everything on accelerators, the one moving the fewest bytes
per call, for pipelines that do not fit resident (docs/design.md, "When it does not fit").

Each component gets one of three residency levels, and every component that is not resident executes on one
`home` accelerator (their phases never overlap, so they share its room, and what one phase leaves free there
another can load per call):
- WHOLE: resident whole (or split along its blocks), placed first, on the accelerator with the most room
  once the home keeps room for the other components' phases;
- FILL: as many units resident as the other phases leave room for (`fill`), in priority order -- the
  component that runs most first, then the largest -- so a denoiser that cannot stay whole keeps what the
  others' phases allow, loads more at its phase and streams the remainder;
- STREAM: nothing resident; loaded per call and streamed at its phase (what a component that runs once
  loses by this is nothing: it moves its bytes once per call either way).
What is not resident is split into loaded-per-call and streamed units in its own phase's room (`host_split`).

Every level x home combination is evaluated (3^n x accelerators; a denoiser pipeline has 3 to 6 components,
so at most a few thousand) unless a lower bound rules it out: the components at STREAM move every byte their call runs at
least once. Past EXACT_LIMIT combinations the smallest components are only tried at FILL and STREAM, and past
that at FILL (the bound). All-FILL in priority order, blocks taken in execution order, is the reference policy
(benchmarks/reference_policy.py) on that home; it is one of the candidates, so the search never does worse than it.
The bound and the bytes are `cost`'s (`least_bytes_per_call`, `bytes_per_call`).
Candidates compare by `cost.PlanCost` (bytes on the CPU, bytes per call, crossing edges, the fullest device);
the strategy's own plan competes too (`strategies.fewest_transfers`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Optional, Sequence

from ..cost import least_bytes_per_call, minimum_phase_weights
from ..memory_model import Ledger
from .fill import Filled, fill_resident
from .host_split import HostSplit, split_host_part
from .rooms import away_rooms, phase_room, spreadable  # spreadable: re-exported (benchmarks read it here)

EXACT_LIMIT = 2_000  # level x home combinations evaluated exhaustively (each is a fraction of a millisecond)


class Level(str, Enum):
    STREAM = "stream"
    FILL = "fill"
    WHOLE = "whole"


@dataclass(frozen=True, kw_only=True)
class Choice:
    levels: tuple[Level, ...]  # one per component, in priority order
    home: int
    in_order: bool = False  # FILL takes blocks in execution order (the reference policy's way), not largest first


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """One candidate, evaluated: its cost, the ledger, the resident placements and each other component's units."""

    choice: Choice
    cost: object  # cost.PlanCost
    ledger: Ledger
    whole: dict  # name -> Placed (WHOLE components, and the pinned ones placed before)
    filled: dict[str, Filled]  # FILL and STREAM components, in priority order
    hosts: dict[str, str]  # "cpu" or "disk", per component with host-homed units
    splits: dict[str, HostSplit]


def priority_order(requests: Sequence, runs) -> list:
    """The component that runs most first, then the largest, then execution order."""
    return sorted(requests, key=lambda r: (-runs.get(r.name, 1), -r.bytes, r.position))


def choices(order: Sequence, homes: Sequence[int], runs, limit: int = EXACT_LIMIT) -> Iterator[Choice]:
    """Every level x home combination (within `limit`, the smallest components get fewer levels), those with
    the fewest bytes certainly moved (the STREAM ones') first."""
    options = [tuple(Level) for _ in order]
    by_size = sorted(range(len(order)), key=lambda i: (order[i].bytes, -i))
    for reduced in (Level.FILL, Level.STREAM), (Level.FILL,):
        for i in by_size:
            if _count(options) * len(homes) <= limit:
                break
            options[i] = reduced
    combos = sorted(itertools.product(*options), key=lambda levels: lower_bound(order, levels, runs))
    for levels in combos:
        for home in homes:
            yield Choice(levels=levels, home=home)
        if all(level is Level.FILL for level in levels):  # the reference policy itself is one candidate
            yield from (Choice(levels=levels, home=home, in_order=True) for home in homes)


def lower_bound(order: Sequence, levels: Sequence[Level], runs) -> int:
    """Bytes per call a candidate moves at least: its STREAM components', all of their bytes homed on the host
    (the blocks the call never runs move nothing: `active_bytes`)."""
    return sum(least_bytes_per_call(request.active_bytes, runs=runs.get(request.name, 1))
               for request, level in zip(order, levels) if level is Level.STREAM)


def _count(options) -> int:
    total = 1
    for option in options:
        total *= len(option)
    return total


def fill_and_split(ledger: Ledger, choice: Choice, order: Sequence, runs, *,
                   cache: Optional[dict] = None) -> Optional[tuple[dict[str, Filled], dict[str, HostSplit]]]:
    """FILL components' resident units (priority order), then every non-resident part's per-call / streamed
    split in its phase (on the home, and for blocks that may run elsewhere on the other accelerators: `rooms`);
    None when a phase does not fit. `cache` keeps the splits of STREAM
    components (all of their units on the host) by room, across candidates."""
    cache = {} if cache is None else cache
    filled: dict[str, Filled] = {}
    for request, level in zip(order, choice.levels):
        if level is Level.FILL:  # resident room for the blocks the call runs; the idle ones stay on the host
            filled[request.name] = fill_resident(
                ledger, name=request.name, units=request.active_units, activation=request.transient,
                home=choice.home, devices=ledger.accelerators, spread=request.spread_blocks,
                in_order=choice.in_order)
            filled[request.name].host.extend(u for u in request.layout_units if u.path in request.idle)
        elif level is Level.STREAM:
            filled[request.name] = Filled(host=list(request.layout_units))
    splits = {}
    for request in order:
        if request.name not in filled:
            continue
        room, away = phase_room(ledger, choice.home, request), away_rooms(ledger, request, choice.home)
        host = sorted(filled[request.name].host, key=lambda unit: request.unit_rank[unit.path])  # unit order
        key = (request.name, room, away) if len(host) == len(request.layout_units) else None
        split = cache.get(key) if key else None
        if split is None:
            split = split_host_part(host, runs=runs.get(request.name, 1), room=room, idle=request.idle, away=away,
                                    spread=request.spread_blocks)
            if key:
                cache[key] = split
        if not split.fits:
            return None
        settle_phases(ledger, request, choice.home, split)
        splits[request.name] = split
    return filled, splits


def settle_phases(ledger: Ledger, request, home, split: HostSplit) -> None:
    """The component's phase on its execution device (activations, what it loads there, blocks in flight) and
    on each accelerator it loads blocks per call onto (activations and those blocks)."""
    ledger.set_phase(home, request.name, request.transient + split.phase_weights)
    for device, loaded in split.away_bytes().items():
        ledger.set_phase(device, request.name, request.transient + loaded)


def reserve_phases(ledger: Ledger, choice: Choice, order: Sequence) -> bool:
    """Room on the home for the least each non-resident component needs in its phase; False if it lacks it."""
    for request, level in zip(order, choice.levels):
        if level is Level.WHOLE:
            continue
        need = request.transient + minimum_phase_weights(request.active_units)
        if not ledger.fits(choice.home, weights=0, transient=need):
            return False
        ledger.add(choice.home, transient=need, phase=request.name)
    return True
