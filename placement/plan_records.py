"""The Plan's records: what one component, one device, one fallback and the verdict say, as frozen pydantic models
with no logic beyond their own fields. Data only, so that the modules that derive the Plan's reports, drawings,
seconds and host memory read them without importing the Plan (`plan_schema`), which imports those modules.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictInt, field_validator

from .cost import bytes_per_call
from .devices import device_label, normalize_device
from .sizes import format_bytes

PlanDevice = Annotated[Union[StrictInt, str], AfterValidator(normalize_device)]


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanInputs(FrozenModel):
    """What the plan was asked for, so that a JSON file says what it answers."""

    strategy: Any  # as given: a name, a device, or {component: device | {submodule: device}}
    max_memory: Optional[dict[PlanDevice, int]]  # in bytes; None: detected on the planning machine
    dtype: Union[None, str, dict[str, Optional[str]]]  # None: each tensor's own dtype
    call: Optional[dict[str, Any]] = None  # the call planned for (None: weights only)
    offload_folder: Optional[str] = None
    runs_per_call: Optional[dict[str, int]] = None  # as given (components not named run once)
    link_bandwidth: Optional[float] = None  # bytes/s as given (None: the default was assumed)
    gpu: Optional[str] = None  # the GPU profile's key, as named (None: detected or assumed)
    # The accelerators the planning machine had (virtual ones included); a plan for more is simulated.
    accelerators_present: Optional[int] = None

    @field_validator("link_bandwidth", mode="before")
    @classmethod
    def _positive_speed(cls, value):
        return None if value is None else positive_number(value)

    @classmethod
    def record(cls, *, strategy, max_memory, dtype, offload_folder, call=None, runs_per_call=None,
               link_bandwidth=None, accelerators_present=None, gpu=None) -> "PlanInputs":
        return cls(strategy=_plain(strategy), max_memory=max_memory, dtype=_plain(dtype),
                   offload_folder=None if offload_folder is None else str(offload_folder), call=call,
                   runs_per_call=None if runs_per_call is None else dict(runs_per_call),
                   link_bandwidth=link_bandwidth, accelerators_present=accelerators_present, gpu=gpu)


def _plain(value: Any) -> Any:
    """torch.device / torch.dtype -> "cuda:1" / "bfloat16"; dicts recursively; ints, strings and None kept."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (int, str)):
        return value
    return str(value).removeprefix("torch.")


class PlacementKind(str, Enum):
    """How a component's weights are placed (docs/design.md, "placement kinds")."""

    WHOLE = "whole"  # on one accelerator
    SPLIT = "split"  # its submodules over several accelerators, cut only between no-split blocks
    OFFLOADED = "offloaded"  # weights in CPU RAM, executed on an accelerator by streaming blocks
    CPU = "cpu"  # weights in CPU RAM, runs on the CPU
    DISK = "disk"  # weights on disk, streamed to the execution device




class ComponentTransfer(FrozenModel):
    """What crosses the host -> accelerator bus for one component per call, in steady state (docs/design.md "When
    it does not fit: what moves per call"): resident modules stay; per-call modules are loaded at the phase's
    start and kept through its runs; streamed modules move block by block at every run. Every host-homed module
    of a component executing on an accelerator is in one of the two lists; a CPU component moves nothing.
    """

    runs_per_call: int = 1
    resident_bytes: int = 0
    loaded_per_call_bytes: int = 0
    streamed_per_run_bytes: int = 0
    per_call_modules: list[str] = []
    streamed_modules: list[str] = []
    # The blocks in flight at once while streaming (`cost.stream_buffer`: one computing, the next prefetched).
    stream_buffer_bytes: int = 0
    # Per-call modules brought to another accelerator than the execution device, module -> accelerator.
    per_call_devices: dict[str, int] = {}
    # Streamed modules streamed onto another accelerator than the execution device, module -> accelerator: the
    # GPU whose span of blocks they run in, through its own stream buffers (pooled residency).
    streamed_devices: dict[str, int] = {}

    @property
    def bytes_per_call(self) -> int:
        return bytes_per_call(loaded=self.loaded_per_call_bytes, streamed=self.streamed_per_run_bytes,
                              runs=self.runs_per_call)


class MemoryTechnique(str, Enum):

    VAE_TILING = "vae_tiling"  # decode (and encode) one overlapping spatial/temporal tile at a time
    VAE_SLICING = "vae_slicing"  # decode (and encode) one sample of the batch at a time


class PlannedTechnique(FrozenModel):
    """A memory technique the load applies for a component, why, and its activation peak without it."""

    technique: MemoryTechnique
    reason: str
    activation_bytes_without: Optional[int] = None


class ComponentPlan(FrozenModel):
    """Where one component lives (`device_map`, relative to it: `{"": 0}` whole) and where it runs."""

    name: str
    kind: PlacementKind
    devices: list[PlanDevice]  # where the weights live, in device order
    execution_device: PlanDevice
    bytes: int
    dtype: Optional[str] = None
    device_map: dict[str, PlanDevice]
    placed_bytes: dict[PlanDevice, int]  # weight bytes per device, in device order (sums to `bytes`)
    activation_bytes: Optional[int] = None
    # Why its activations are not counted though the plan has a call (its estimate failed; weights only), or None.
    activations_not_counted: Optional[str] = None
    # Its streaming working set: host-homed weights on the execution device at once (per call + in flight).
    streamed_unit_bytes: int = 0
    pinned: bool = False  # placed by the caller (dict strategy or already-dispatched), not by the strategy
    transfer: Optional[ComponentTransfer] = None  # None in files written before the transfer model existed
    memory_techniques: list[PlannedTechnique] = []  # turned on by the plan, applied by the load (VAE tiling)
    # What one run computes and touches at the planned call (None: not known, planned without a call or before v4).
    flops_per_run: Optional[int] = None
    bytes_touched_per_run: Optional[int] = None

    @field_validator("flops_per_run", "bytes_touched_per_run", mode="before")
    @classmethod
    def _work_counts(cls, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"must be a whole number >= 0 (or null: not known), got {value!r}")
        return value


class DevicePlan(FrozenModel):
    """One device's budget and what it holds: predicted_peak = resident weight_bytes + activation_peak (the
    largest of `phases`, what each component's phase brings beyond them) + overhead."""

    device: PlanDevice
    budget: Optional[int]  # None: unlimited (disk without a "disk" budget)
    detected: bool = False  # True when the budget was detected (free memory minus the margin), not given
    weight_bytes: int
    activation_peak: int
    overhead: int
    predicted_peak: int
    left: Optional[int]
    # activation_peak split in the plan's vocabulary, filled by Plan (activations None without a call).
    activations: Optional[int] = None
    streaming_working_set: int = 0
    loaded_per_call: int = 0  # the part of streaming_working_set loaded once per call (not streamed per run)
    # component -> bytes its phase brings here beyond the resident weights (none: left out; empty before v3).
    phases: dict[str, int] = {}

    @property
    def phase_peaks(self) -> dict[str, int]:
        return {name: self.weight_bytes + extra + self.overhead for name, extra in self.phases.items()}

    @property
    def peak_phase(self) -> Optional[str]:
        """The component whose phase sets the predicted peak (None: no phase brings anything here)."""
        if not self.phases or max(self.phases.values()) == 0:
            return None
        return max(self.phases, key=lambda name: self.phases[name])

    @property
    def budget_source(self) -> str:
        if self.budget is None:
            return "unlimited (no budget given)"
        return "detected (free memory minus a margin)" if self.detected else "given (max_memory)"


class Fallback(FrozenModel):
    """A component that could not be placed whole, the kind it got instead, and why. `demoted`: streamed on
    purpose so that others execute on an accelerator (`strategies.search`)."""

    component: str
    kind: PlacementKind
    reason: str
    demoted: bool = False


class VerdictKind(str, Enum):

    FITS = "fits on accelerators"
    OFFLOADED = "fits with offloading"
    PARTLY_CPU = "runs partly on the CPU"
    NO_FIT = "does not fit"


class Verdict(FrozenModel):
    """What a user reads first: the outcome, the fullest device's share of its budget, the warnings that matter."""

    kind: VerdictKind
    fullest_device: Optional[PlanDevice]
    fullest_share: Optional[float]  # its predicted peak / its budget
    fullest_peak: Optional[int] = None
    fullest_budget: Optional[int] = None
    warnings: list[str]
    # The predicted seconds per call in one line, with the GPU they assume (None: no FLOPs known, `time_line`).
    time: Optional[str] = None
    # The host RAM the placement needs in one line (`host_memory.HostMemory.summary`; None: it homes nothing there).
    host_memory: Optional[str] = None

    @property
    def headline(self) -> str:
        text = f"Verdict: {self.kind.value}"
        if self.kind is VerdictKind.PARTLY_CPU and self.fullest_device == "cpu":  # no accelerator in use at all
            text = "Verdict: runs on the CPU only (no accelerator holds or runs anything)"
        if self.fullest_device is not None and self.fullest_share is not None:
            text += f"; fullest device {device_label(self.fullest_device)} at {self.fullest_share:.1%} of its budget"
            if self.fullest_peak is not None and self.fullest_budget is not None:
                text += f" (predicted peak {format_bytes(self.fullest_peak)} of {format_bytes(self.fullest_budget)})"
        return text + "."


def positive_number(value) -> float:
    """A plan's bytes/s field: a positive finite number (a bool, a string, zero or a negative is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"must be a positive finite number of bytes per second, got {value!r}")
    return float(value)
