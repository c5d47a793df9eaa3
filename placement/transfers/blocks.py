"""A component's blocks as the transfer model sees them: which ones a planned call never runs, which ones move
and which stay (spread evenly), and the room a phase leaves for the host-homed ones, on its execution device
and on the accelerators its blocks may run on.

Idle blocks (`idle_units`) are the blocks a planned call never runs (a text-to-image call's VAE runs `decode` only:
its encoder's blocks stay idle), read from the call's traced module order (`unit_order.record_module_order`).

The runtime streams a block when it runs (a hook on it), so a streamed block the call never runs moves
nothing and needs no room in flight: the transfer model counts it in neither the bytes nor the stream buffer,
and keeps it on the host (resident room goes to blocks that run). Only blocks: a module of the rest may be
used without being called (a tied embedding read as a head's weight), so the rest is always counted. Without a
traced call every block is taken to run.

Which blocks of a run stay on the accelerator and which move is spread evenly, not first-come.

A streamed block's copy hides behind the compute that runs while it travels (docs/design.md, "Seconds, not
only bytes"). Keeping the first blocks of a run on the accelerator and streaming the last ones puts every copy
in a row at the end, each behind one block's compute at most; spreading the kept blocks evenly between the
moved ones (what mmgp/Wan2GP and cache-dit do by hand) gives each copy the kept blocks before it as well. The
set sizes do not change, only which blocks: bytes per call and the blocks in flight stay the same.

`moved_evenly(blocks, count)` picks the `count` blocks that move: each at the end of its share of the run, so
the kept blocks come before the moved ones (`R R S R R S`, `R S S R S S`). Blocks of several sizes are spread
within each size (FLUX's double and single blocks), since which sizes move is what sets the bytes.

Rooms (`phase_room`, `away_rooms`): the room a component's phase leaves for its host-homed weights, on its
execution device and, when its blocks may run elsewhere, on the other accelerators (`split_host_part` loads blocks per
call there).

In component k's phase a device holds everyone's resident weights, the runtime overhead and k's activations
(charged to every accelerator k runs blocks on, as the memory model does for a split); what is left is k's.
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
    """Paths of the blocks among `units` that no call in `traced_order` (submodule paths called) ran."""
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
    """Bytes free for `request`'s host-homed weights on `device` while it runs (None: unlimited)."""
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
