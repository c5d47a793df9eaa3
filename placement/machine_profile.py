"""This machine's profile: what `placement calibrate` measured once (per GPU its copies and throughputs, the CPU's
throughput, the checkpoint drive's read speed, host RAM) and what placed runs corrected since, saved as versioned
JSON in the user's cache. Plans made here without `gpu=` use it where it matches the GPU present (by name) and
name it: "profile: measured on this machine 2026-12-08 (~/.cache/pipeline-placement/machine-profile.json)".

Only the figures the time model reads become a `GpuProfile`: the measured bf16/fp32 matmul rates (a forward reaches
`FORWARD_SHARE` of a large GEMM's), the attention rate (SDPA: a forward's attention is that kernel at such
shapes) and the convolution rate (a VAE's convolutions at `FORWARD_SHARE` of a large 3x3 conv's, the norms and
resampling between them costing the rest), the device copy speed, the pinned and pageable host -> GPU copies;
a correction multiplies the compute rates (`compute_scale`) or replaces the link speed.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .devices import detect_accelerators, is_accelerator
from .errors import PlanError
from .gpu_profiles import CPU_FORWARD_EFFICIENCY, GpuProfile, choose_gpu, cpu_flops_per_s, match_device_name

PROFILE_VERSION = 1
CACHE_ENV = "PLACEMENT_CACHE_DIR"  # where the profile lives instead of the user's cache (tests, shared machines)
FILE_NAME = "machine-profile.json"
VIRTUAL_NAME = "virtual accelerator (CPU)"  # PLACEMENT_VIRTUAL_ACCELERATORS: the CPU computes and copies
CPU_NAME = "cpu"  # the key of the CPU's correction
# A diffusion forward is not one large GEMM (norms, attention, small matmuls): the share of the measured GEMM rate
# it reaches before a run corrects it (cuBLAS' large GEMMs run ~75% of peak, a DiT step ~60%: 0.6 / 0.75).
FORWARD_SHARE = 0.8


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DeviceMeasurement(_Record):
    """One accelerator as measured: bytes/s and FLOP/s by dtype name ("bfloat16", "float8_e4m3fn")."""

    index: int
    name: str  # as CUDA reports it, or `VIRTUAL_NAME`
    kind: str  # torch's device type: "cuda", "vgpu"
    pinned_copy_bytes_per_s: Optional[float] = None
    pageable_copy_bytes_per_s: Optional[float] = None
    memory_bytes_per_s: Optional[float] = None  # read + written by a device -> device copy
    matmul_flops: dict[str, float] = {}
    attention_flops: dict[str, float] = {}
    conv_flops: dict[str, float] = {}


class HostMeasurement(_Record):
    cpu: str
    cores: int
    ram_bytes: int
    matmul_flops: dict[str, float] = {}
    conv_flops: dict[str, float] = {}
    disk_read_bytes_per_s: Optional[float] = None
    disk_folder: Optional[str] = None  # where the read was timed


class Correction(_Record):
    """What placed runs measured against their plans, for one device (a GPU's name, `VIRTUAL_NAME` or "cpu")."""

    compute_scale: float = 1.0  # multiplies the compute throughput the plan assumed
    link_bytes_per_s: Optional[float] = None  # host -> device copies as measured; None: the profile's
    date: str
    why: list[str] = []


class MachineProfile(_Record):
    version: Literal[1] = PROFILE_VERSION
    measured_on: Optional[str] = None  # ISO date of `placement calibrate`; None: only corrections so far
    host: Optional[HostMeasurement] = None
    gpus: list[DeviceMeasurement] = []
    not_measured: list[str] = []  # what calibrate could not measure, and why
    corrections: dict[str, Correction] = Field(default_factory=dict)

    def device(self, name: str) -> Optional[DeviceMeasurement]:
        return next((gpu for gpu in self.gpus if gpu.name == name), None)

    def corrected(self, device: str, *, compute_scale: Optional[float] = None, link: Optional[float] = None,
                  why: str) -> "MachineProfile":
        """This profile with `device`'s correction updated: `compute_scale` multiplies the previous one."""
        old = self.corrections.get(device) or Correction(date=today())
        new = Correction(compute_scale=old.compute_scale * (compute_scale or 1.0),
                         link_bytes_per_s=link if link is not None else old.link_bytes_per_s,
                         date=today(), why=[*old.why[-4:], why])
        return self.model_copy(update={"corrections": {**self.corrections, device: new}})


def today() -> str:
    return datetime.date.today().isoformat()


def profile_path() -> Path:
    """`$PLACEMENT_CACHE_DIR`, else `$XDG_CACHE_HOME/pipeline-placement`, else `~/.cache/pipeline-placement`."""
    folder = os.environ.get(CACHE_ENV, "").strip()
    if not folder:
        cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(cache, "pipeline-placement")
    return Path(folder) / FILE_NAME


def load_profile(path: Optional[Path] = None) -> Optional[MachineProfile]:
    """The saved profile, None when there is none; a file that is not one is an error naming it."""
    path = profile_path() if path is None else Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime_ns: int, size: int) -> MachineProfile:  # once per version of the file
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] > PROFILE_VERSION:
            raise PlanError(f"The machine profile {path} has version {data['version']}, newer than this library "
                            f"reads ({PROFILE_VERSION}); run `placement calibrate` again or upgrade.")
        return MachineProfile.model_validate(data)
    except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as error:
        first = str(error).splitlines()[0]
        raise PlanError(f"The machine profile {path} cannot be read ({first}); run `placement calibrate` to "
                        f"measure it again, or delete the file (or set {CACHE_ENV} to another folder).") from None


def save_profile(profile: MachineProfile, path: Optional[Path] = None) -> Path:
    """Write `profile` atomically (a temporary file renamed over the old one); returns where."""
    path = profile_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".machine-profile-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(profile.model_dump_json(indent=2))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


class MachineChoice(BaseModel):
    """What a plan takes from the profile: its GPU profile (named in `gpu.source`), the link and the disk."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    gpu: GpuProfile
    link: Optional[tuple[float, str]] = None  # (bytes/s, source) where a present GPU was measured or corrected
    disk: Optional[tuple[float, str]] = None


def present_device_name(accelerators) -> Optional[str]:
    """The name of the accelerator a plan using `accelerators` runs on when they are this process's: CUDA's name
    for the first, `VIRTUAL_NAME` for virtual ones; None when they are not present (a plan for other GPUs)."""
    used = sorted(d for d in accelerators if is_accelerator(d))
    present = detect_accelerators()
    if not used or used[-1] >= present.count:
        return None
    if present.virtual:
        return VIRTUAL_NAME
    if present.kind == "cuda":
        import torch

        return torch.cuda.get_device_name(used[0])
    return None


def machine_choice(accelerators, path: Optional[Path] = None) -> Optional[MachineChoice]:
    """The profile's figures for a plan using `accelerators` made without `gpu=`; None without a saved profile."""
    profile = load_profile(path)
    if profile is None:
        return None
    where = profile_path() if path is None else Path(path)
    label = f"profile: measured on this machine {profile.measured_on}" if profile.measured_on else \
        "profile: this machine's corrections"
    name = present_device_name(accelerators)
    measured = None if name is None else profile.device(name)
    base, base_source = (gpu_from_measurement(measured), f"{label} ({name})") if measured is not None \
        else choose_gpu(None, accelerators)
    correction = profile.corrections.get(name) if name is not None else None
    cpu_flops = _cpu_flops(profile)
    gpu, notes = _corrected(base, correction, measured, cpu_flops)
    if measured is not None or correction is not None:
        source = f"{label if measured is not None else base_source}{notes}; {where}"
    else:
        source = f"{base_source}; CPU and disk: {label} ({where})"
    gpu = gpu.model_copy(update={"source": source})
    link = None
    if gpu.measured_link_bytes_per_s is not None:
        link = (gpu.measured_link_bytes_per_s, f"{label}: host -> {name}{notes}")
    disk = None
    if profile.host is not None and profile.host.disk_read_bytes_per_s:
        disk = (profile.host.disk_read_bytes_per_s, f"{label} ({profile.host.disk_folder})")
    return MachineChoice(gpu=gpu, link=link, disk=disk)


def _cpu_flops(profile: MachineProfile) -> Optional[float]:
    """The CPU's forward FLOP/s: its measured fp32 matmul at the share a CPU forward reaches
    (`gpu_profiles.CPU_FORWARD_EFFICIENCY`, as for the rate measured per process), times its correction."""
    rate = (profile.host.matmul_flops.get("float32") if profile.host is not None else None)
    correction = profile.corrections.get(CPU_NAME)
    if rate is None and correction is None:
        return None
    base = cpu_flops_per_s("float32") if rate is None else rate * CPU_FORWARD_EFFICIENCY
    return base * (correction.compute_scale if correction is not None else 1.0)


def _corrected(base: GpuProfile, correction: Optional[Correction], measured: Optional[DeviceMeasurement],
               cpu_flops: Optional[float]) -> tuple[GpuProfile, str]:
    update: dict = {}
    if cpu_flops is not None:
        update["cpu_flops"] = cpu_flops
    notes = ""
    if correction is not None and correction.compute_scale != 1.0:
        # A run's compute is FLOP- or memory-bound (time_model.run_seconds): the correction scales both.
        scaled = ("bf16_tflops", "fp32_tflops", "memory_gb_s", "fp8_tflops", "measured_attention_tflops",
                  "measured_conv_tflops")
        update.update({field: getattr(base, field) * correction.compute_scale for field in scaled
                       if getattr(base, field) is not None})
        notes += f", compute x{correction.compute_scale:.2g}"
    if correction is not None and correction.link_bytes_per_s is not None:
        update["measured_link_bytes_per_s"] = correction.link_bytes_per_s
        notes += f", link {correction.link_bytes_per_s / 1e9:.3g} GB/s"
    if notes:
        notes = f"; corrected by placed runs {correction.date}{notes}"
    return base.model_copy(update=update), notes


def _peak_for(rate: float, attribute: str, dtype: Optional[str]) -> float:
    """The datasheet-style figure `attribute` that makes the time model assume `rate` (it scales linearly)."""
    probe = GpuProfile(key="probe", name="probe", bf16_tflops=1.0, fp32_tflops=1.0, memory_gb_s=1.0, pcie_gen=4)
    unit = probe.memory_bytes_per_s if attribute == "memory_gb_s" else probe.flops_per_s(dtype)
    return rate / unit


def gpu_from_measurement(measured: DeviceMeasurement) -> GpuProfile:
    """The `GpuProfile` the time model reads, from one measured device; what was not measured comes from the
    datasheet row of its name (else the matmul rates stand in: fp32 for bf16 and back)."""
    known = match_device_name(measured.name) if measured.kind == "cuda" else None
    bf16 = measured.matmul_flops.get("bfloat16") or measured.matmul_flops.get("float16")
    fp32 = measured.matmul_flops.get("float32")
    fp8 = measured.matmul_flops.get("float8_e4m3fn")
    bf16, fp32 = bf16 or fp32, fp32 or bf16
    if bf16 is None:
        raise PlanError(f"The machine profile's {measured.name} has no matmul rate; run `placement calibrate` again.")
    memory = measured.memory_bytes_per_s
    return GpuProfile(
        key=known.key if known is not None else "machine", name=measured.name,
        bf16_tflops=_peak_for(bf16 * FORWARD_SHARE, "bf16_tflops", "bfloat16"),
        fp32_tflops=_peak_for(fp32 * FORWARD_SHARE, "fp32_tflops", "float32"),
        fp8_tflops=(_peak_for(fp8 * FORWARD_SHARE, "bf16_tflops", "bfloat16") if fp8
                    else None if known is None else known.fp8_tflops),
        memory_gb_s=(_peak_for(memory, "memory_gb_s", None) if memory  # calibrate always measures it; a
                     else known.memory_gb_s if known is not None else 1000.0),  # hand-written one may not
        pcie_gen=known.pcie_gen if known is not None else 4,
        measured_link_bytes_per_s=measured.pinned_copy_bytes_per_s,
        measured_pageable_link_bytes_per_s=measured.pageable_copy_bytes_per_s,
        measured_attention_tflops=_sixteen_bit(measured.attention_flops, 1.0),
        measured_conv_tflops=_sixteen_bit(measured.conv_flops, FORWARD_SHARE))


def _sixteen_bit(rates: dict[str, float], share: float) -> Optional[float]:
    """TFLOP/s a forward reaches from measured `rates` by dtype (bf16, else fp16, else fp32: what was measured),
    at `share` of the kernel's; None when none was measured."""
    rate = rates.get("bfloat16") or rates.get("float16") or rates.get("float32")
    return None if not rate else rate * share / 1e12


__all__ = ["CACHE_ENV", "CPU_NAME", "Correction", "DeviceMeasurement", "HostMeasurement", "MachineChoice",
           "MachineProfile", "VIRTUAL_NAME", "gpu_from_measurement", "load_profile", "machine_choice",
           "present_device_name", "profile_path", "save_profile"]
