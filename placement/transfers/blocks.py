"""A component's blocks as the transfer model sees them: which ones a planned call never runs (`idle_units`: they
move nothing and need no room in flight), which ones move and which stay, spread evenly so that each copy hides
behind the kept blocks' compute before it (`moved_evenly`, what mmgp and cache-dit do by hand), and the room a
phase leaves for host-homed weights on its execution device and the accelerators its blocks may run on.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, TypeVar

from torch import nn

from ..devices import Device
from ..memory_model import Ledger
from ..streaming import BLOCK_CONTAINERS, TransferUnit, block_groups


Unit = TypeVar("Unit")


def moved_positions(total: int, count: int) -> list[int]:
    """Positions (0-based, of `total`) of the `count` blocks that move: the last of each of `count` equal
    shares of the run, so each moved block has the kept blocks of its share before it."""
    if count <= 0:
        return []
    return [i for i in range(total) if (i + 1) * count // total > i * count // total]


def moved_evenly(blocks: Sequence[Unit], counts: Mapping[int, int], size=lambda unit: unit.bytes) -> list[Unit]:
    """The blocks that move, `counts[s]` of each size `s`, spread evenly within each size (execution order)."""
    chosen: list[Unit] = []
    for each in sorted(set(size(unit) for unit in blocks)):
        members = [unit for unit in blocks if size(unit) == each]
        wanted = min(counts.get(each, 0), len(members))
        chosen.extend(members[i] for i in moved_positions(len(members), wanted))
    order = {id(unit): index for index, unit in enumerate(blocks)}
    return sorted(chosen, key=lambda unit: order[id(unit)])


def kept_evenly(blocks: Sequence[Unit], count: int) -> list[Unit]:
    """`count` of `blocks` (one size) kept, the others spread evenly between them (`moved_positions`)."""
    moved = set(moved_positions(len(blocks), len(blocks) - count))
    return [unit for index, unit in enumerate(blocks) if index not in moved]


def idle_units(module: nn.Module, units: Sequence[TransferUnit], traced_order: Sequence[str]) -> frozenset[str]:
    """Paths of the blocks among `units` that no call in `traced_order` (submodule paths called) ran. Only blocks:
    a module of the rest may be used without being called (a tied embedding read as a head's weight)."""
    ran: set[str] = set()
    for path in traced_order:
        parts = path.split(".") if path else []
        ran.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    modules = dict(module.named_modules())
    return frozenset(unit.path for unit in units if unit.block and unit.path in modules and unit.path not in ran)


def is_idle(path: str, idle: frozenset[str]) -> bool:
    """`path` is one of the blocks `idle` or lies inside one (a finer map's key)."""
    if not idle:
        return False
    if path in idle:
        return True
    parts = path.split(".")
    return any(".".join(parts[:end]) in idle for end in range(1, len(parts)))


def phase_room(ledger: Ledger, device: Device, request) -> Optional[int]:
    """Bytes free for `request`'s host-homed weights on `device` while it runs (None: unlimited): the budget less
    the overhead, everyone's resident weights and its activations."""
    if not ledger.has(device) or ledger.loads[device].budget is None:
        return None
    load = ledger.loads[device]
    return load.budget - ledger.overhead(device) - load.weights - request.transient


def away_rooms(ledger: Ledger, request, home: Device) -> tuple[tuple[int, int], ...]:
    """(accelerator, room) for every budgeted accelerator other than `home` where `request`'s blocks may be
    loaded per call (none when no block of it may leave its execution device: `spread_blocks`)."""
    if not request.spread_blocks:
        return ()
    rooms = []
    for device in ledger.accelerators:
        room = None if device == home else phase_room(ledger, device, request)
        if room is not None and room > 0:
            rooms.append((device, room))
    return tuple(rooms)


def spreadable(request) -> bool:
    """Whether all its blocks may sit on several accelerators (`spread_blocks` holds every one of them)."""
    return len(spread_blocks(request)) == len(block_groups(request.module).block_paths)


def spread_blocks(request) -> frozenset[str]:
    """The blocks that may run on another accelerator than the execution device: those with no module on the
    way down to their block list (the root included) that is one of its `_no_split_modules` (a cut inside one
    would separate tensors its forward joins: HunyuanVideo's token refiner keeps its blocks; the transformer
    blocks beside it may go)."""
    protected = set(request.size.no_split_classes)
    if type(request.module).__name__ in protected:
        return frozenset()
    layout = block_groups(request.module)
    holders = {path: module for path, module in layout.rest_modules
               if path and any(isinstance(child, BLOCK_CONTAINERS) for child in module.modules())}
    kept_in = [path for path, module in holders.items() if type(module).__name__ in protected]
    return frozenset(path for path in layout.block_paths if not any(inside(path, holder) for holder in kept_in))


def inside(path: str, container: str) -> bool:
    return path == container or path.startswith(f"{container}.")
