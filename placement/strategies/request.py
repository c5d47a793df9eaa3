"""What a strategy knows of one component, and the record it produces for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional

import torch
from torch import nn

from ..devices import Device, device_sort_key
from ..plan_schema import ComponentPlan, Fallback, PlacementKind
from ..sizes import format_bytes
from ..sizing import ComponentSize
from ..streaming import TransferUnit, transfer_units
from ..transfers.blocks import spread_blocks


@dataclass(frozen=True, kw_only=True)
class ComponentRequest:
    """One module component to place: its size at the requested dtype and its activation peak."""

    name: str
    module: nn.Module
    size: ComponentSize
    dtype: Optional[torch.dtype]
    activation: Optional[int]  # None: activations not accounted for
    position: int  # in execution order
    streamed: int  # bytes on the execution device at once when offloaded (streaming.streaming_working_set)
    units: tuple[TransferUnit, ...] = ()  # streaming.transfer_units (empty: computed when asked for)
    # Paths of the units (modules) the planned call never runs (`idle_units`; empty without a traced call).
    idle: frozenset[str] = frozenset()

    @property
    def layout_units(self) -> tuple[TransferUnit, ...]:
        """The pieces the transfer planner keeps resident, loads per call or streams (rest first, then blocks)."""
        return self.units or transfer_units(self.module, self.size)

    @cached_property
    def unit_rank(self) -> dict[str, int]:
        """Each layout unit's index (its execution order among the blocks)."""
        return {unit.path: index for index, unit in enumerate(self.layout_units)}

    @cached_property
    def spread_blocks(self) -> frozenset[str]:
        """The blocks that may run on another accelerator than its execution device (`transfers.rooms`)."""
        return spread_blocks(self)

    @property
    def active_units(self) -> tuple[TransferUnit, ...]:
        """The layout units the planned call runs (all of them without a traced call)."""
        if not self.idle:
            return self.layout_units
        return tuple(unit for unit in self.layout_units if unit.path not in self.idle)

    @property
    def bytes(self) -> int:
        return self.size.total

    @cached_property
    def active_bytes(self) -> int:
        """Its bytes less the blocks the planned call never runs: what moves at least once per call when none
        of it is resident (an idle block, streamed, moves nothing)."""
        return self.bytes - sum(unit.bytes for unit in self.layout_units if unit.path in self.idle)

    @property
    def transient(self) -> int:
        return self.activation or 0

    @property
    def dtype_name(self) -> Optional[str]:
        """The requested dtype, else the module's own (its first floating tensor's), so plans always say it."""
        dtype = self.dtype
        if dtype is None:
            floating = (t.dtype for t in [*self.module.parameters(), *self.module.buffers()] if t.is_floating_point())
            dtype = next(floating, None)
        return None if dtype is None else str(dtype).removeprefix("torch.")

    def needs(self) -> str:
        """"vae needs 1.21 GiB (bfloat16) + 0.30 GiB of activations" for error and fallback messages."""
        text = f"{self.name} needs {format_bytes(self.bytes)}"
        if self.dtype_name:
            text += f" ({self.dtype_name})"
        if self.activation:
            text += f" + {format_bytes(self.activation)} of activations"
        return text


@dataclass(frozen=True, kw_only=True)
class Placed:
    """A strategy's answer for one component: its plan, and the fallback taken if it is not whole."""

    plan: ComponentPlan
    fallback: Optional[Fallback] = None


@dataclass
class Placements:
    """The answers collected so far, by component name (mutable while a plan is built)."""

    by_name: dict[str, Placed] = field(default_factory=dict)

    def add(self, placed: Placed) -> None:
        self.by_name[placed.plan.name] = placed


def component_plan(
    request: ComponentRequest,
    *,
    kind: PlacementKind,
    device_map: Mapping[str, Device],
    execution_device: Device,
    placed_bytes: Mapping[Device, int],
    streamed_unit_bytes: int = 0,
    pinned: bool = False,
) -> ComponentPlan:
    ordered = {device: placed_bytes[device] for device in sorted(placed_bytes, key=device_sort_key)}
    return ComponentPlan(
        name=request.name,
        kind=kind,
        devices=list(ordered),
        execution_device=execution_device,
        bytes=request.bytes,
        dtype=request.dtype_name,
        device_map=dict(device_map),
        placed_bytes=ordered,
        activation_bytes=request.activation,
        streamed_unit_bytes=streamed_unit_bytes,
        pinned=pinned,
    )
