"""The blocks a planned call never runs (a text-to-image call's VAE runs `decode` only: its encoder's blocks
stay idle), read from the call's traced module order (`unit_order.record_module_order`).

The runtime streams a block when it runs (a hook on it), so a streamed block the call never runs moves
nothing and needs no room in flight: the transfer model counts it in neither the bytes nor the stream buffer,
and keeps it on the host (resident room goes to blocks that run). Only blocks: a module of the rest may be
used without being called (a tied embedding read as a head's weight), so the rest is always counted. Without a
traced call every block is taken to run.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..streaming import TransferUnit


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
