"""Which blocks of a run stay on the accelerator and which move: spread evenly, not first-come.

A streamed block's copy hides behind the compute that runs while it travels (docs/design.md, "Seconds, not
only bytes"). Keeping the first blocks of a run on the accelerator and streaming the last ones puts every copy
in a row at the end, each behind one block's compute at most; spreading the kept blocks evenly between the
moved ones (what mmgp/Wan2GP and cache-dit do by hand) gives each copy the kept blocks before it as well. The
set sizes do not change, only which blocks: bytes per call and the blocks in flight stay the same.

`moved_evenly(blocks, count)` picks the `count` blocks that move: each at the end of its share of the run, so
the kept blocks come before the moved ones (`R R S R R S`, `R S S R S S`). Blocks of several sizes are spread
within each size (FLUX's double and single blocks), since which sizes move is what sets the bytes.
"""

from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

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


__all__ = ["kept_evenly", "moved_evenly", "moved_positions"]
