"""What a strategy is given and gives back: the parsed `strategy` argument (`StrategySpec`), one component
(`ComponentRequest`), the immutable request (`StrategyRequest`) and what it built (`PlacementState`). A strategy
places into a copy of the starting ledger, so searches compare trials without writing into a caller's objects.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..component_options import FormatLimit
from ..cost import CostModel, PlanCost
from ..device_maps import single_device
from ..devices import Device, device_sort_key, is_accelerator
from ..errors import InvalidDeviceError, PlanError
from ..memory_model import Ledger
from ..plan_schema import ComponentPlan, Fallback, PlacementKind
from ..sizes import format_bytes
from ..sizing import ComponentSize
from ..streaming import TransferUnit, transfer_units
from ..transfers.blocks import spread_blocks
from ..transfers.residency import component_transfers


class StrategyKind(str, Enum):
    BALANCED = "balanced"
    AUTO = "auto"  # the same as balanced (documented, not an error)
    SEQUENTIAL = "sequential"
    BALANCED_LOW_0 = "balanced_low_0"
    DICT = "dict"  # pinned as given, the rest balanced around it
    DEVICE = "device"  # everything on one device


class StrategyScope(str, Enum):
    """What a strategy places: a pipeline's components (whole first), or one model's submodules with
    accelerate's model-level meaning of the same names (`model_level`)."""

    PIPELINE = "pipeline"
    MODEL = "model"


NAMED_STRATEGIES = (StrategyKind.BALANCED, StrategyKind.AUTO, StrategyKind.SEQUENTIAL, StrategyKind.BALANCED_LOW_0)
SUPPORTED = (
    "'balanced', 'auto', 'sequential', 'balanced_low_0', a dict {component: device | {submodule: device}}, "
    "or a single device ('cuda', 'cuda:1', 0, 'cpu', a torch.device)"
)


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    kind: StrategyKind
    device: Optional[Device] = None  # DEVICE only
    pins: Optional[Mapping] = None  # DICT only
    degraded: bool = False  # no accelerator to plan for: everything on the CPU (disk when RAM is short)
    scope: StrategyScope = StrategyScope.PIPELINE

    @property
    def model_level(self) -> bool:
        """A named strategy or a {submodule: device} dict for one model: `strategies.model_level` places it."""
        return self.scope is StrategyScope.MODEL and self.kind is not StrategyKind.DEVICE and not self.degraded

    @property
    def label(self) -> str:
        """What the Plan records as its strategy."""
        if self.degraded:
            return "cpu"
        if self.kind is StrategyKind.DEVICE:
            return f"cuda:{self.device}" if is_accelerator(self.device) else str(self.device)
        return self.kind.value


def parse_strategy(strategy, *, scope: StrategyScope | str = StrategyScope.PIPELINE) -> StrategySpec:
    """The one parser of `strategy` / `device_map` arguments. At model scope a dict maps submodule (or
    tensor) paths of the one model to devices; a single device means the same at both scopes.
    "disk" as a single device is a PlanError quoting `check_can_execute`: it cannot execute."""
    scope = StrategyScope(scope)
    if isinstance(strategy, Mapping):
        return StrategySpec(kind=StrategyKind.DICT, pins=strategy, scope=scope)
    if isinstance(strategy, str) and strategy.strip().lower() in {kind.value for kind in NAMED_STRATEGIES}:
        return StrategySpec(kind=StrategyKind(strategy.strip().lower()), scope=scope)
    try:
        device = single_device(strategy)
    except InvalidDeviceError as error:  # "disk": the one check says why; the strategy list says what instead
        raise PlanError(f"Unknown placement strategy {strategy!r} ({error}). Supported: {SUPPORTED}.") from None
    if device is not None:
        return StrategySpec(kind=StrategyKind.DEVICE, device=device, scope=scope)
    raise PlanError(f"Unknown placement strategy {strategy!r}{_did_you_mean(strategy)}. Supported: {SUPPORTED}.")


def _did_you_mean(strategy) -> str:
    """'; did you mean 'balanced'?' for a strategy name one slip away ("balance", "Sequental"), else ''."""
    if not isinstance(strategy, str):
        return ""
    close = difflib.get_close_matches(strategy.strip().lower(), sorted(kind.value for kind in NAMED_STRATEGIES), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    limit: Optional[FormatLimit] = None  # placements its weight format cannot run in (never proposed)

    def refuses(self, kind: PlacementKind) -> bool:
        return self.limit is not None and self.limit.refuses(kind)

    def host_allowed(self, host: str) -> bool:
        """Whether its weights may be homed on `host` ("cpu" RAM or "disk") and streamed to an accelerator."""
        return not self.refuses(PlacementKind.OFFLOADED if host == "cpu" else PlacementKind.DISK) and not (
            host == "disk" and self.refuses(PlacementKind.OFFLOADED))

    def refusal(self, kind: PlacementKind, why: str):
        """The error when it can go nowhere but `kind`, which its format cannot run (`FormatLimit.error`)."""
        return self.limit.error(self.name, self.bytes, kind, why)

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
        """The blocks that may run on another accelerator than its execution device (`blocks.spread_blocks`)."""
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


def component_plan(request: ComponentRequest, *, kind: PlacementKind, device_map: Mapping[str, Device],
                   execution_device: Device, placed_bytes: Mapping[Device, int], streamed_unit_bytes: int = 0,
                   pinned: bool = False) -> ComponentPlan:
    ordered = {device: placed_bytes[device] for device in sorted(placed_bytes, key=device_sort_key)}
    return ComponentPlan(name=request.name, kind=kind, devices=list(ordered), execution_device=execution_device,
                         bytes=request.bytes, dtype=request.dtype_name, device_map=dict(device_map),
                         placed_bytes=ordered, activation_bytes=request.activation,
                         streamed_unit_bytes=streamed_unit_bytes, pinned=pinned)


def charge(ledger: Ledger, placed: Placed, request: ComponentRequest) -> Placed:
    """Record `placed` in `ledger`: weights per device (a split's activations on every accelerator it spans), the
    transient (activations, streamed block) on the execution device. A device without a budget (a dict naming an
    accelerator not in max_memory) is not tracked: loading onto it is refused later if the machine lacks it."""
    plan = placed.plan
    for device, weights in plan.placed_bytes.items():
        spans = plan.kind is PlacementKind.SPLIT and is_accelerator(device)
        if ledger.has(device):
            ledger.add(device, weights=weights, transient=request.transient if spans else 0, phase=request.name)
    if ledger.has(plan.execution_device):
        ledger.add(plan.execution_device, transient=request.transient + plan.streamed_unit_bytes, phase=request.name)
    return placed


@dataclass(frozen=True, kw_only=True)
class Context:
    """Planning options every strategy step may need, and what one plan() call may reuse across attempts."""

    has_offload_folder: bool
    # (component, rooms) -> its split device map (None: no split fits). Strategies that try several orders,
    # and the placement search, place the same component into the same rooms again; a split is costly to find.
    split_cache: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class StrategyRequest:
    """The components a strategy places, the state it starts from, and the planning options.

    `ledger` and `placed` are a snapshot: a strategy copies them (`start()`) before placing anything.
    """

    spec: StrategySpec
    requests: tuple[ComponentRequest, ...]
    ledger: Ledger
    placed: Mapping[str, Placed]  # components placed before this strategy runs (pinned ones)
    context: Context
    costs: CostModel
    # False: skip the last tie-break (fewest moves from the zig-zag map). The placement search compares many
    # candidates by cost, which that tie-break never changes; it re-runs the winner with it.
    thorough: bool = True

    @classmethod
    def build(cls, *, spec, requests: Sequence[ComponentRequest], ledger: Ledger, placed, context, costs):
        return cls(spec=spec, requests=tuple(requests), ledger=ledger.copy(), placed=MappingProxyType(dict(placed)),
                   context=context, costs=costs)

    def start(self) -> tuple[Ledger, Placements]:
        """A private copy of the starting state to place into."""
        return self.ledger.copy(), Placements(by_name=dict(self.placed))

    def cost(self, by_name: Mapping[str, Placed], ledger: Ledger) -> PlanCost:
        """What the placements `by_name` (every component, the starting ones included) cost under `ledger`,
        counting the components this request places."""
        ours = {r.name: r for r in self.requests}
        transfers = component_transfers(by_name, ours, ledger, self.costs.runs)
        return self.costs.cost({name: placed.plan for name, placed in by_name.items()}, transfers, ledger)


@dataclass(frozen=True, kw_only=True)
class PlacementState:
    """What a strategy built: the ledger after placing, every placement (the starting ones included), the
    warnings it raised, why the map differs from the familiar zig-zag (`Plan.map_reasons`) and why an accelerator
    holds nothing (`Plan.left_empty`)."""

    ledger: Ledger
    by_name: Mapping[str, Placed]
    warnings: tuple[str, ...] = ()
    map_reasons: tuple[str, ...] = field(default=())
    left_empty: Mapping[Device, str] = field(default_factory=dict)

    @classmethod
    def of(cls, ledger: Ledger, placements: Placements, **notes) -> "PlacementState":
        return cls(ledger=ledger, by_name=MappingProxyType(dict(placements.by_name)), **notes)


Strategy = Callable[[StrategyRequest], PlacementState]
