"""The Plan: the single output of planning, a frozen pydantic model with no torch objects inside, and its JSON.

Devices are spelled as in every device map: ints for accelerators, "cpu", "disk" (pydantic's smart union keeps
`0` an int through JSON). The memory vocabulary shared by `explain()`, `to_svg()` and the JSON: weights
(resident), activations, streaming working set (host-homed weights the running component holds), runtime
overhead, predicted peak (weights + the largest phase + overhead), left. Bytes moved per call become seconds at
`link_bandwidth`; FLOPs per run become seconds on the `gpu` profile (`time_model`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import PrivateAttr, ValidationError, computed_field, field_validator, model_validator

from .devices import Device, is_accelerator, normalize_device
from .drawings import plan_svg, timeline as predicted_timeline
from .errors import PlanError
from .gpu_profiles import GpuProfile, gpu_profile, invalid_fields_text
from .host_memory import HostMemory, budget_note, host_memory
# The records, re-exported: `plan_schema` stays the one place a reader of plans imports from.
from .plan_records import (ComponentPlan, ComponentTransfer, DevicePlan, Fallback, FrozenModel, MemoryTechnique,
                           PlacementKind, PlanDevice, PlanInputs, PlannedTechnique, Verdict, VerdictKind,
                           positive_number)
from .rates import DISK_BYTES_PER_S, PCIE_BYTES_PER_S
from .reports import explain_plan, fullest_device, verdict_warnings, with_breakdown
from .time_model import plan_time, time_line

# 1: no schema_version (older files). 2: inputs, verdict, memory breakdown. 3: the transfer model (older files:
# transfer None, no phases). 4: the time model (older: no FLOPs). 5: host memory and the disk read speed.
SCHEMA_VERSION = 5
DEFAULT_LINK_BANDWIDTH = PCIE_BYTES_PER_S
DEFAULT_LINK_SOURCE = "assumed: PCIe 4.0 x16"
DEFAULT_DISK_SOURCE = "assumed: NVMe"
_DERIVED = ("verdict", "transfer_bytes_per_call", "transfer_seconds_per_call", "seconds_per_call", "host_memory")
DEFAULT_GPU_SOURCE = "assumed: no GPU named (gpu=) or present"


class Plan(FrozenModel):
    schema_version: int = SCHEMA_VERSION
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
    # Why the map differs from diffusers' zig-zag map, and why each accelerator it leaves empty holds nothing.
    map_reasons: list[str] = []
    left_empty: dict[PlanDevice, str] = {}
    inputs: Optional[PlanInputs] = None  # None in version-1 files
    # Host -> accelerator bytes/s the seconds of `transfer_seconds_per_call` assume, and where it came from.
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH
    link_bandwidth_source: str = DEFAULT_LINK_SOURCE
    # The GPU profile the seconds assume (None in files before v4: the default), and where it came from.
    gpu: Optional[GpuProfile] = None
    gpu_source: str = DEFAULT_GPU_SOURCE
    # Disk read bytes/s the seconds of disk-homed weights assume, and where it came from.
    disk_read_bandwidth: float = DISK_BYTES_PER_S
    disk_read_bandwidth_source: str = DEFAULT_DISK_SOURCE

    @field_validator("link_bandwidth", "disk_read_bandwidth", mode="before")
    @classmethod
    def _positive_speed(cls, value):
        return positive_number(value)

    @model_validator(mode="before")
    @classmethod
    def _read_version(cls, data: Any) -> Any:
        """Old files (no schema_version) load as version 1; derived fields are recomputed, not read."""
        if isinstance(data, dict):
            data = {key: value for key, value in data.items() if key not in _DERIVED}
            version = data.get("schema_version", 1)
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise PlanError(
                    f"This plan has schema_version {version!r}; this library reads versions 1 to {SCHEMA_VERSION}. "
                    "Upgrade pipeline-placement or re-plan with this version."
                )
            data["schema_version"] = SCHEMA_VERSION
        return data

    @model_validator(mode="after")
    def _split_transients(self) -> "Plan":
        # Derived from the components, so version-1 files get it too; frozen, hence object.__setattr__.
        object.__setattr__(self, "devices", [with_breakdown(d, self) for d in self.devices])
        return self

    @computed_field
    @property
    def verdict(self) -> Verdict:
        devices, components = self.devices, list(self.components.values())
        if any(d.left is not None and d.left < 0 for d in devices):
            kind = VerdictKind.NO_FIT
        elif any(c.execution_device == "cpu" for c in components):
            kind = VerdictKind.PARTLY_CPU
        elif any(c.kind in (PlacementKind.OFFLOADED, PlacementKind.DISK) for c in components):
            kind = VerdictKind.OFFLOADED
        else:
            kind = VerdictKind.FITS
        fullest = fullest_device(devices)
        return Verdict(
            kind=kind,
            fullest_device=None if fullest is None else fullest.device,
            fullest_share=None if fullest is None else fullest.predicted_peak / fullest.budget,
            fullest_peak=None if fullest is None else fullest.predicted_peak,
            fullest_budget=None if fullest is None else fullest.budget,
            warnings=verdict_warnings(components, devices, link_bandwidth=self.link_bandwidth,
                                      link_source=self.link_bandwidth_source,
                                      disk_bandwidth=self.disk_read_bandwidth) + [
                note for note in [budget_note(self.host_memory)] if note],
            time=time_line(self),
            host_memory=self.host_memory.summary() if self.host_memory.total_bytes else None,
        )

    @computed_field
    @property
    def host_memory(self) -> HostMemory:
        return host_memory(self.components, self.devices)

    @computed_field
    @property
    def transfer_bytes_per_call(self) -> Optional[int]:
        """Host -> accelerator bytes one call moves in steady state (None for files before the transfer model)."""
        transfers = [c.transfer for c in self.components.values()]
        if self.components and all(t is None for t in transfers):
            return None
        return sum(t.bytes_per_call for t in transfers if t is not None)

    @computed_field
    @property
    def transfer_seconds_per_call(self) -> Optional[float]:
        """`transfer_bytes_per_call` at `link_bandwidth`, as if nothing overlapped it with compute."""
        moved = self.transfer_bytes_per_call
        return None if moved is None else moved / self.link_bandwidth

    @computed_field
    @property
    def seconds_per_call(self) -> Optional[float]:
        """Predicted seconds of one call on `gpu` (`time_model`); None when no component's FLOPs are known."""
        if all(c.flops_per_run is None for c in self.components.values()):
            return None
        return self.time_per_call().seconds

    def time_per_call(self, gpu: "GpuProfile | str | None" = None):
        """`time_model.CallTime` on the plan's GPU profile or on `gpu` (a name, as `gpu=` takes it)."""
        return plan_time(self, None if gpu is None else gpu_profile(gpu))

    def timeline(self, gpu: "GpuProfile | str | None" = None) -> dict:
        """The predicted call as Chrome trace JSON (`drawings.timeline`), as `hooks.trace_calls()` records one."""
        return predicted_timeline(self, None if gpu is None else gpu_profile(gpu))

    def with_inputs(self, **changes: Any) -> "Plan":
        """A copy whose `inputs` record `changes` (e.g. `call=`) on top of what was recorded."""
        base = {"strategy": self.strategy, "max_memory": None, "dtype": None}
        if self.inputs is not None:
            base = self.inputs.model_dump()
        return self.model_copy(update={"inputs": PlanInputs(**{**base, **changes})})

    @property
    def device_map(self) -> dict[str, Device]:
        """The flat map of docs/design.md: `{"text_encoder": 1, "denoiser.blocks.0": 0, ...}`."""
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

    @property
    def simulated_accelerators(self) -> list[int]:
        """The accelerators planned for that the planning machine did not have."""
        present = None if self.inputs is None else self.inputs.accelerators_present
        return [] if present is None else [d for d in self.accelerators if d >= present]

    def device(self, device: Device) -> DevicePlan:
        device = normalize_device(device)
        for entry in self.devices:
            if entry.device == device:
                return entry
        raise KeyError(f"The plan has no device {device!r}; it has {[d.device for d in self.devices]}.")

    # What would do better, worked out when asked (`advise`): a loader attaches how to re-plan; not serialized.
    _advice: Any = PrivateAttr(default=None)
    _advised: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Plans are equal when they place the same way: the advice a loader attaches is not part of the plan."""
        if not isinstance(other, Plan):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = FrozenModel.__hash__

    def with_advice(self, advice) -> "Plan":
        """A copy whose `advise()` calls `advice()` (once) for its lines."""
        copy = self.model_copy()
        copy._advice, copy._advised = advice, None
        return copy

    def advise(self) -> list[str]:
        """The single changes that would do better than this plan, each found by re-planning with it (computed
        once, when first asked); empty for a plan that fits resident or one made by `placement.plan` alone."""
        if self._advised is None:
            self._advised = [] if self._advice is None else list(self._advice())
        return list(self._advised)

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """A plan from `to_json()` output, of this version or an older one (files without schema_version)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"Not a plan JSON file: {error}.") from error
        except RecursionError:
            raise PlanError("Not a plan JSON file: it nests deeper than a JSON reader can follow.") from None
        if not isinstance(data, dict):
            raise PlanError(f"Not a plan JSON file: the top level is a {type(data).__name__}, not an object.")
        cls._read_version(data)  # a version it cannot read raises the PlanError itself, outside pydantic's wrapping
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise PlanError(invalid_fields_text(error, "plan file")) from None

    def to_svg(self) -> str:
        """A bar per device against its budget, then the components with the edges that cross devices, in SVG."""
        return plan_svg(self)

    def explain(self) -> str:
        """A table a person reads at a glance: components x devices in GiB, per-device peaks, then reasons."""
        return explain_plan(self)
