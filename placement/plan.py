"""The Plan: the single output of planning, a frozen pydantic model with no torch objects inside.

Devices are spelled as in every device map: ints for accelerators, "cpu", "disk". The JSON round trip gives
the ints back as ints (pydantic's smart union keeps `0` an int and `"cpu"` a string).
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictInt

from .devices import Device, is_accelerator, normalize_device

PlanDevice = Annotated[Union[StrictInt, str], AfterValidator(normalize_device)]


class PlacementKind(str, Enum):
    """How a component's weights are placed (DESIGN.md, "placement kinds")."""

    WHOLE = "whole"  # on one accelerator
    SPLIT = "split"  # its submodules over several accelerators, cut only between no-split blocks
    OFFLOADED = "offloaded"  # weights in CPU RAM, executed on an accelerator by streaming blocks
    CPU = "cpu"  # weights in CPU RAM, runs on the CPU
    DISK = "disk"  # weights on disk, streamed to the execution device


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ComponentPlan(_Frozen):
    """Where one component lives and where it runs.

    `device_map` is relative to the component: `{"": 0}` whole, `{"blocks.0": 0, "blocks.1": 1, ...}` split,
    `{"": "cpu"}` offloaded (executing on `execution_device`) or cpu, `{"": "disk"}` disk.
    """

    name: str
    kind: PlacementKind
    devices: list[PlanDevice]  # where the weights live, in device order
    execution_device: PlanDevice
    bytes: int
    dtype: Optional[str] = None
    device_map: dict[str, PlanDevice]
    placed_bytes: dict[PlanDevice, int]  # weight bytes per device, in device order (sums to `bytes`)
    activation_bytes: Optional[int] = None
    streamed_unit_bytes: int = 0  # offloaded/disk: the largest block moved to the execution device at once
    pinned: bool = False  # placed by the caller (dict strategy or already-dispatched), not by the strategy


class DevicePlan(_Frozen):
    """One device's budget and what the plan predicts it holds at its peak.

    predicted_peak = weight_bytes + activation_peak + overhead, where activation_peak is the largest
    transient among the components executing here (they run one after another): activations plus, for an
    offloaded component, its largest streamed block.
    """

    device: PlanDevice
    budget: Optional[int]  # None: unlimited (disk without a "disk" budget)
    detected: bool = False  # True when the budget was detected (free memory minus the margin), not given
    weight_bytes: int
    activation_peak: int
    overhead: int
    predicted_peak: int
    left: Optional[int]


class Fallback(_Frozen):
    """A component that could not be placed whole, the kind it got instead, and why (with the numbers).

    `demoted`: the component was kept off the accelerators' resident room on purpose (streamed instead of
    whole or split) because that let others execute on an accelerator rather than on the CPU; see
    `strategies.demotion`.
    """

    component: str
    kind: PlacementKind
    reason: str
    demoted: bool = False


class Plan(_Frozen):
    strategy: str
    components: dict[str, ComponentPlan]  # in execution order
    devices: list[DevicePlan]
    crossing_edges: list[tuple[str, str]]
    fallbacks: list[Fallback]
    activations_accounted: bool
    warnings: list[str]
    budget_margin: str = ""  # how detected budgets were derived, for explain()
    # The order the strategy placed components in: pinned ones first, demoted ones (streamed on purpose) last.
    placement_order: list[str] = []
    # Why the strategy's map differs from diffusers' zig-zag map, with the numbers (empty when it does not).
    map_reasons: list[str] = []

    @property
    def device_map(self) -> dict[str, Device]:
        """The flat DESIGN.md map: `{"text_encoder": 1, "denoiser.blocks.0": 0, ...}`."""
        flat: dict[str, Device] = {}
        for name, component in self.components.items():
            for path, device in component.device_map.items():
                flat[f"{name}.{path}" if path else name] = device
        return flat

    def component_device_map(self, name: str) -> dict[str, Device]:
        """The device map of one component, relative to it (what `dispatch` takes)."""
        if name not in self.components:
            raise KeyError(f"The plan has no component {name!r}; it has {sorted(self.components)}.")
        return dict(self.components[name].device_map)

    @property
    def execution_order(self) -> list[str]:
        return list(self.components)

    @property
    def accelerators(self) -> list[int]:
        return [d.device for d in self.devices if is_accelerator(d.device)]

    def device(self, device: Device) -> DevicePlan:
        device = normalize_device(device)
        for entry in self.devices:
            if entry.device == device:
                return entry
        raise KeyError(f"The plan has no device {device!r}; it has {[d.device for d in self.devices]}.")

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        return cls.model_validate_json(text)

    def explain(self) -> str:
        """A table a person reads at a glance: components x devices in GiB, per-device peaks, then reasons."""
        from .explain import explain_plan  # explain imports this module; import here to avoid a cycle

        return explain_plan(self)
