"""Parsing the `strategy` argument into one of the fixed kinds docs/design.md defines."""

from __future__ import annotations

import difflib

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional

from ..device_maps import single_device
from ..devices import Device, is_accelerator
from ..errors import InvalidDeviceError, PlanError


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
