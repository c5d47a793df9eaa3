"""Synthetic components of exact sizes, built on meta, for planner tests.

`component([1, 2, 3], head=1)` is a module whose `blocks` are three `Block`s of 1, 2 and 3 units and whose
`head` is a leaf of 1 unit; a unit is UNIT bytes (float32 elements on meta: nothing is allocated). The root
names `Block` in `_no_split_modules`, so a device map may cut between blocks, never inside one.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from placement.sizes import GiB

UNIT = GiB


class Block(nn.Module):
    """Two parameters, so that a device map cutting inside the block would be possible, and wrong."""

    def __init__(self, nbytes: int):
        super().__init__()
        first = nbytes // 2 // 4 * 4
        self.first = nn.Parameter(torch.empty(first // 4, device="meta"), requires_grad=False)
        self.second = nn.Parameter(torch.empty((nbytes - first) // 4, device="meta"), requires_grad=False)


class Leaf(nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nbytes // 4, device="meta"), requires_grad=False)


class SyntheticComponent(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, block_bytes: Sequence[int], head_bytes: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList([Block(n) for n in block_bytes])
        if head_bytes:
            self.head = Leaf(head_bytes)


def component(block_units: Sequence[float], head: float = 0, unit: int = UNIT) -> SyntheticComponent:
    """A component of `block_units` blocks (and an optional head), each a multiple of `unit` bytes."""
    return SyntheticComponent([_bytes(n, unit) for n in block_units], _bytes(head, unit))


def whole(units: float, blocks: int = 1, unit: int = UNIT) -> SyntheticComponent:
    """A component of `units` in total, cut into `blocks` equal blocks."""
    return component([units / blocks] * blocks, unit=unit)


def _bytes(units: float, unit: int) -> int:
    return int(round(units * unit / 4)) * 4
