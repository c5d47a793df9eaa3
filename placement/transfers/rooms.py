"""The room a component's phase leaves for its host-homed weights, on its execution device and, when its
blocks may run elsewhere, on the other accelerators (`host_split` loads blocks per call there).

In component k's phase a device holds everyone's resident weights, the runtime overhead and k's activations
(charged to every accelerator k runs blocks on, as the memory model does for a split); what is left is k's.
"""

from __future__ import annotations

from typing import Optional

from ..devices import Device
from ..memory_model import Ledger
from ..streaming import BLOCK_CONTAINERS, block_groups


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
