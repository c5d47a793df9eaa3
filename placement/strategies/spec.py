"""Parsing the `strategy` argument into one of the fixed kinds DESIGN.md defines."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional

import torch

from ..devices import Device, is_accelerator, normalize_device
from ..errors import InvalidDeviceError, StrategyError


class StrategyKind(str, Enum):
    BALANCED = "balanced"
    AUTO = "auto"  # the same as balanced (documented, not an error)
    SEQUENTIAL = "sequential"
    BALANCED_LOW_0 = "balanced_low_0"
    DICT = "dict"  # pinned as given, the rest balanced around it
    DEVICE = "device"  # everything on one device


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

    @property
    def label(self) -> str:
        """What the Plan records as its strategy."""
        if self.degraded:
            return "cpu"
        if self.kind is StrategyKind.DEVICE:
            return f"cuda:{self.device}" if is_accelerator(self.device) else str(self.device)
        return self.kind.value


def parse_strategy(strategy) -> StrategySpec:
    if isinstance(strategy, Mapping):
        return StrategySpec(kind=StrategyKind.DICT, pins=strategy)
    if isinstance(strategy, str) and strategy.strip().lower() in {kind.value for kind in NAMED_STRATEGIES}:
        return StrategySpec(kind=StrategyKind(strategy.strip().lower()))
    if isinstance(strategy, (str, int, torch.device)) and not isinstance(strategy, bool):
        try:
            device = normalize_device(strategy)
        except InvalidDeviceError:
            device = None
        if device is not None and device != "disk":
            return StrategySpec(kind=StrategyKind.DEVICE, device=device)
    raise StrategyError(f"Unknown placement strategy {strategy!r}. Supported: {SUPPORTED}.")
