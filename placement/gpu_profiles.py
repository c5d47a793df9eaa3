"""Device profiles: what one GPU computes and moves per second, so a plan can turn FLOPs and bytes into seconds.

Each row is a datasheet's dense peak (16-bit with fp32 accumulate, as PyTorch's GEMMs run: half the fp16-accumulate
figure NVIDIA quotes first for GeForce cards; fp8; fp32), memory bandwidth and host link: NVIDIA's Ampere GA102 and
Ada AD102 whitepapers (RTX 3060 Ti, 3090, 4090), the Blackwell GB202 whitepaper and the RTX 5060 / 5090 spec pages,
the RTX PRO 5000 / 6000 Blackwell datasheets (dense bf16 = the quoted fp4-sparse "AI TOPS" / 8, full-rate fp32
accumulate as on every professional card), the L4, L20, L40S, A100, H100 and H200 datasheets, the HGX B200 / B300
datasheets (per GPU: the 8-GPU board's dense figure / 8; B300's host link is PCIe 6.0 through ConnectX-8), AMD's
MI300X and MI350X datasheets. Each row names its architecture; `ARCHITECTURES` says what share of the peak a real
diffusion forward gets on it (`time_model`, fitted to benchmarks/data/published_runs.csv). `gpu="measure"` times this process's CUDA GPU instead, once per
process: asked for, never the default, since a measurement varies from run to run and a named profile does not.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import statistics
import time
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .devices import detect_accelerators, is_accelerator
from .errors import PlanError

# Share of the dense peak a diffusion forward reaches on a GPU whose architecture the table does not know (a
# profile made by hand without `architecture`): GEMMs 70-80%, attention 30-70%, norms at memory speed.
COMPUTE_EFFICIENCY = 0.6
# Share of the peak memory bandwidth a streaming kernel reaches (STREAM-like copies reach 80-90%).
MEMORY_EFFICIENCY = 0.8
# Share of the PCIe link a pinned host -> GPU copy of a whole block sustains after protocol overhead and the copy
# engine's own limits: published whole-component and per-layer pinned copies ran 20 GB/s on an RTX 4090 (PCIe 4,
# 0.63 of 31.5) and 36-44 GB/s on an RTX 5090 / H200 (PCIe 5, 0.57-0.70 of 63): fitted 0.63.
LINK_EFFICIENCY = 0.63
# GB/s per lane and direction, after line coding (128b/130b from gen 3 on; gen 6: 64 GT/s PAM4 in 256-byte FLITs).
PCIE_LANE_GB_S = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_LANES = (1, 2, 4, 8, 16)
# The CPU computes what a plan leaves on it at this machine's own rate, measured once per process
# (`cpu_flops_per_s`: a GEMM in the component's dtype, scaled by `CPU_FORWARD_EFFICIENCY`). A stated figure
# (0.5 TFLOPS, a 16-core desktop) predicted tiny-dit's 2-step 512x512 call on a 2-core machine at 1.4 s; it took
# 31.4 s: a CPU's speed varies 50x between machines, so it is measured, never assumed (measured so, the same call
# is predicted 79 s and took 58 s on a 2-core machine at load 11).
# 2.1 GFLOP per product: large enough for the GEMM's sustained rate (a 512 product ran at 30% of it on a loaded
# 2-core machine), milliseconds on a desktop CPU, about 50 ms on a loaded 2-core one.
CPU_MATMUL_SIDE = 1024
CPU_MEASURE_SECONDS = 0.1
# Share of a CPU's GEMM rate a whole forward reaches (convolutions, norms, attention and elementwise ops run below
# the GEMM's rate, and eager PyTorch adds per-op overhead on small tensors).
CPU_FORWARD_EFFICIENCY = 0.3


class Efficiency(BaseModel):
    """Shares of the bf16 datasheet peak a diffusion forward reaches on one architecture, run eagerly with PyTorch's
    SDPA (fitted to benchmarks/data/published_runs.csv; `time_model` applies the backend and compile factors):
    `matmul` the linear layers, `attention` the attention kernels, `conv` a VAE's convolutions and norms."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul: float
    attention: float
    conv: float


# Fitted per architecture where the published rows have it (benchmarks/published_runs.py, 35 rows): Ada on Wan 2.1
# 14B forwards on an RTX 4090 and FLUX.1-dev / Qwen-Image text encoders; Hopper on Wan 2.1 14B (H100), Wan 2.2 and
# FLUX.1-dev (H100, H200) and FLUX's VAE (H100); CDNA 4 on Wan 2.2 (MI350). Hopper run eagerly reaches 40% on GEMMs
# and 34% in SDPA: its peak needs FA3, fused kernels and large tiles. The others take their sibling's figures,
# stated rather than measured: Ampere and consumer / workstation Blackwell Ada's, datacenter Blackwell Hopper's,
# CDNA 3 CDNA 4's; a consumer card's convolutions at 0.2 of its (lower) peak.
ARCHITECTURES: dict[str, Efficiency] = {
    "ampere": Efficiency(matmul=0.75, attention=0.72, conv=0.2),
    "ada": Efficiency(matmul=0.75, attention=0.72, conv=0.2),
    "blackwell-rtx": Efficiency(matmul=0.75, attention=0.72, conv=0.2),
    "hopper": Efficiency(matmul=0.4, attention=0.34, conv=0.07),
    "blackwell": Efficiency(matmul=0.4, attention=0.34, conv=0.07),
    "cdna3": Efficiency(matmul=0.32, attention=0.32, conv=0.07),
    "cdna4": Efficiency(matmul=0.32, attention=0.32, conv=0.07),
}
DEFAULT_EFFICIENCY = Efficiency(matmul=COMPUTE_EFFICIENCY, attention=COMPUTE_EFFICIENCY, conv=COMPUTE_EFFICIENCY / 5)
DEFAULT_GPU = "rtx4090"  # what a plan made without a GPU named or present assumes (PCIe 4.0 x16, like the link)


class GpuProfile(BaseModel):
    """One GPU's datasheet peaks (module doc), its host link and its architecture. Every number is checked where
    it enters: a bad field raises `PlanError` naming the field and the value (`invalid_fields_text`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str  # the short name `gpu=` takes: "rtx4090"
    name: str  # as the vendor writes it: "NVIDIA GeForce RTX 4090"
    bf16_tflops: float  # dense, fp32 accumulate
    fp8_tflops: Optional[float] = None  # dense; None: the chip has no fp8 tensor cores
    fp32_tflops: float
    memory_gb_s: float
    pcie_gen: int
    pcie_lanes: int = 16
    # A measured profile's sustained pinned host -> GPU bytes/s and its numbers' source; None for a datasheet row.
    measured_link_bytes_per_s: Optional[float] = None
    source: Optional[str] = None
    # This machine's CPU forward FLOP/s as `placement calibrate` measured it (`machine_profile`); None: measured
    # in this process (`cpu_flops_per_s`).
    cpu_flops: Optional[float] = None
    # The chip's architecture, a key of `ARCHITECTURES` (its efficiencies); None: `DEFAULT_EFFICIENCY`.
    architecture: Optional[str] = None
    # A measured pageable (unpinned) host -> GPU copy's bytes/s; None: `time_model.PAGEABLE_SHARE` of the pinned.
    measured_pageable_link_bytes_per_s: Optional[float] = None
    # A measured profile's forward attention and convolution TFLOP/s in 16 bits (`placement calibrate`'s SDPA and
    # 3x3 conv, `machine_profile`); None: the architecture's fitted shares of the peak (`ARCHITECTURES`).
    measured_attention_tflops: Optional[float] = None
    measured_conv_tflops: Optional[float] = None

    def __init__(self, **fields):
        try:
            super().__init__(**fields)
        except ValidationError as error:
            raise PlanError(invalid_fields_text(error, "GPU profile")) from None

    @field_validator("bf16_tflops", "fp8_tflops", "fp32_tflops", "memory_gb_s", "measured_link_bytes_per_s",
                     "measured_pageable_link_bytes_per_s", "cpu_flops", "measured_attention_tflops",
                     "measured_conv_tflops", mode="before")
    @classmethod
    def _positive(cls, value):
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"must be a positive finite number, got {value!r}")
        return float(value)

    @field_validator("pcie_gen", mode="before")
    @classmethod
    def _known_generation(cls, value):
        if isinstance(value, bool) or value not in PCIE_LANE_GB_S:
            raise ValueError(f"must be a PCIe generation this library knows ({', '.join(map(str, PCIE_LANE_GB_S))}), "
                             f"got {value!r}; for another link give measured_link_bytes_per_s")
        return value

    @field_validator("pcie_lanes", mode="before")
    @classmethod
    def _lane_count(cls, value):
        if isinstance(value, bool) or value not in PCIE_LANES:
            raise ValueError(f"must be one of {', '.join(map(str, PCIE_LANES))}, got {value!r}")
        return value

    @field_validator("architecture", mode="before")
    @classmethod
    def _known_architecture(cls, value):
        if value is not None and value not in ARCHITECTURES:
            raise ValueError(f"must be one of {', '.join(ARCHITECTURES)} (or None), got {value!r}")
        return value

    @property
    def efficiency(self) -> Efficiency:
        """What share of the peaks a real forward reaches on this chip (`ARCHITECTURES`); attention and convolution
        at their measured rates where this profile was measured (`measured_attention_tflops`, `..._conv_...`)."""
        fitted = ARCHITECTURES.get(self.architecture or "", DEFAULT_EFFICIENCY)
        measured = {kind: rate / self.bf16_tflops for kind, rate in
                    (("attention", self.measured_attention_tflops), ("conv", self.measured_conv_tflops)) if rate}
        return fitted.model_copy(update=measured) if measured else fitted

    @property
    def efficiency_source(self) -> str:
        """Where `efficiency`'s attention and convolution shares come from, as explain() says it."""
        measured = [kind for kind, rate in (("attention", self.measured_attention_tflops),
                                            ("conv", self.measured_conv_tflops)) if rate]
        fitted = f"{self.architecture}'s fitted shares" if self.architecture in ARCHITECTURES else \
            "the default shares (no architecture)"
        if not measured:
            return f"attention and conv at {fitted} of the peak"
        rest = [kind for kind in ("attention", "conv") if kind not in measured]
        text = f"{' and '.join(measured)} at the rate measured on this machine"
        return text + (f", {rest[0]} at {fitted} of the peak" if rest else "")

    @property
    def link_bytes_per_s(self) -> float:
        """Host -> GPU bytes/s a pinned copy sustains (`LINK_EFFICIENCY` of the PCIe link), or the measured rate."""
        if self.measured_link_bytes_per_s is not None:
            return self.measured_link_bytes_per_s
        return round(PCIE_LANE_GB_S[self.pcie_gen] * self.pcie_lanes * LINK_EFFICIENCY, 1) * 1e9

    @property
    def link_label(self) -> str:
        if self.measured_link_bytes_per_s is not None:
            return f"measured pinned host -> GPU copy, {self.measured_link_bytes_per_s / 1e9:.1f} GB/s"
        raw = PCIE_LANE_GB_S[self.pcie_gen] * self.pcie_lanes
        return f"PCIe {self.pcie_gen}.0 x{self.pcie_lanes}, {raw:.1f} GB/s x {LINK_EFFICIENCY:g}"

    def peak_flops(self, dtype: Optional[str]) -> float:
        """The datasheet FLOP/s for `dtype` (a plan's dtype label). fp32 runs on the plain cores (no TF32 by
        default); every other dtype computes in 16 bits (fp8, int8, nf4 weights are upcast for the matmul)."""
        peak = self.fp32_tflops if compute_dtype(dtype) in ("float32", "float64") else self.bf16_tflops
        return peak * 1e12

    def flops_per_s(self, dtype: Optional[str]) -> float:
        """FLOP/s a forward in `dtype` reaches when its FLOPs are not split by kind: the matmul efficiency."""
        return self.peak_flops(dtype) * self.efficiency.matmul

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_gb_s * 1e9 * MEMORY_EFFICIENCY


def invalid_fields_text(error: ValidationError, what: str) -> str:
    """A pydantic error said as this library says bad input: each field by its path, its value and what it must
    be; unknown fields named with the known ones."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(the whole object)"
        inner = item.get("ctx", {}).get("error")
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown field {where!r} (value {item['input']!r}): this version does not read it")
        elif isinstance(inner, PlanError):  # a nested model that says its own fields (a GPU profile in a plan)
            lines.append(f"in {where!r}: " + str(inner).removesuffix(FIX))
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"field {where!r} = {item['input']!r}: {message}")
    return f"Invalid {what}: " + "; ".join(lines) + FIX


FIX = ". Fix or drop these fields."


@functools.cache
def cpu_flops_per_s(dtype: str = "float32") -> float:
    """FLOP/s a forward in `dtype` (a compute dtype name) reaches on this machine's CPU: a `CPU_MATMUL_SIDE` GEMM
    timed 3 to 9 times, for up to `CPU_MEASURE_SECONDS` (once per process and dtype; the median product, so one
    preempted product does not set it), times `CPU_FORWARD_EFFICIENCY`."""
    torch_dtype = getattr(torch, dtype, None) if dtype in ("float32", "bfloat16", "float16") else torch.float32
    a = torch.randn(CPU_MATMUL_SIDE, CPU_MATMUL_SIDE).to(torch_dtype)
    b = torch.randn(CPU_MATMUL_SIDE, CPU_MATMUL_SIDE).to(torch_dtype)
    torch.mm(a, b)  # warm-up: the first product pays for thread-pool start and kernel selection
    timings, start = [], time.perf_counter()
    while len(timings) < 3 or (len(timings) < 9 and time.perf_counter() - start < CPU_MEASURE_SECONDS):
        before = time.perf_counter()
        torch.mm(a, b)
        timings.append(max(time.perf_counter() - before, 1e-9))
    return 2 * CPU_MATMUL_SIDE**3 / statistics.median(timings) * CPU_FORWARD_EFFICIENCY


def compute_dtype(label: Optional[str]) -> Optional[str]:
    """The dtype a component computes in, from a plan's dtype label (`gpu_profiles.GpuProfile.flops_per_s`)."""
    if not label:
        return None
    found = re.search(r"compute (\w+)", label)
    return found.group(1) if found else re.split(r"[ +(]", label, maxsplit=1)[0]


def _profile(key, name, bf16, fp8, fp32, memory, gen, architecture, lanes=16) -> GpuProfile:
    return GpuProfile(key=key, name=name, bf16_tflops=bf16, fp8_tflops=fp8, fp32_tflops=fp32, memory_gb_s=memory,
                      pcie_gen=gen, pcie_lanes=lanes, architecture=architecture)


PROFILES: dict[str, GpuProfile] = {p.key: p for p in (
    #         key              name                                   bf16    fp8     fp32   GB/s  PCIe  arch
    _profile("rtx3060ti", "NVIDIA GeForce RTX 3060 Ti", 32.4, None, 16.2, 448, 4, "ampere"),
    _profile("rtx3090", "NVIDIA GeForce RTX 3090", 71.0, None, 35.6, 936, 4, "ampere"),
    _profile("rtx4090", "NVIDIA GeForce RTX 4090", 165.2, 330.3, 82.6, 1008, 4, "ada"),
    _profile("rtx5060", "NVIDIA GeForce RTX 5060", 38.4, 76.7, 19.2, 448, 5, "blackwell-rtx", lanes=8),
    _profile("rtx5090", "NVIDIA GeForce RTX 5090", 209.5, 419.0, 104.8, 1792, 5, "blackwell-rtx"),
    _profile("rtxpro5000", "NVIDIA RTX PRO 5000 Blackwell", 267.8, 535.5, 73.7, 1344, 5, "blackwell-rtx"),
    _profile("rtxpro6000", "NVIDIA RTX PRO 6000 Blackwell", 500.0, 1000.0, 125.0, 1792, 5, "blackwell-rtx"),
    _profile("l4", "NVIDIA L4", 121.0, 242.5, 30.3, 300, 4, "ada"),
    _profile("l20", "NVIDIA L20", 119.5, 239.0, 59.8, 864, 4, "ada"),
    _profile("l40s", "NVIDIA L40S", 362.05, 733.0, 91.6, 864, 4, "ada"),
    _profile("a100-40gb", "NVIDIA A100 40GB", 312.0, None, 19.5, 1555, 4, "ampere"),
    _profile("a100-80gb", "NVIDIA A100 80GB", 312.0, None, 19.5, 2039, 4, "ampere"),
    _profile("h100", "NVIDIA H100 80GB HBM3", 989.4, 1978.9, 66.9, 3350, 5, "hopper"),
    _profile("h200", "NVIDIA H200", 989.4, 1978.9, 66.9, 4800, 5, "hopper"),
    _profile("b200", "NVIDIA B200", 2250.0, 4500.0, 75.0, 8000, 5, "blackwell"),
    _profile("b300", "NVIDIA B300", 2250.0, 4500.0, 75.0, 8000, 6, "blackwell"),
    _profile("mi300x", "AMD Instinct MI300X", 1307.4, 2614.9, 163.4, 5300, 5, "cdna3"),
    _profile("mi350x", "AMD Instinct MI350X", 2307.0, 4614.0, 144.2, 8000, 5, "cdna4"),
)}
# Other spellings of a key (after `_normalise`): "a100" alone is the 80 GB card, the more common one today.
_ALIASES = {"a100": "a100-80gb", "a10040g": "a100-40gb", "a10080g": "a100-80gb", "a100sxm440gb": "a100-40gb",
            "a100sxm480gb": "a100-80gb", "a100pcie40gb": "a100-40gb", "a100pcie80gb": "a100-80gb",
            "h100sxm": "h100", "h100sxm5": "h100", "h10080gbhbm3": "h100", "h200141gb": "h200",
            "mi350": "mi350x", "rtxpro6000blackwell": "rtxpro6000", "rtxpro5000blackwell": "rtxpro5000",
            "b300sxm6ac": "b300", "b200sxm": "b200"}


def _normalise(text: str) -> str:
    """"NVIDIA GeForce RTX 4090" -> "rtx4090": lowercase, vendor and brand words and punctuation dropped."""
    text = text.lower()
    for word in ("nvidia", "geforce", "amd", "instinct", "tesla"):
        text = text.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", text)


_BY_NORMAL = {**{_normalise(k): k for k in PROFILES}, **{_normalise(p.name): k for k, p in PROFILES.items()},
              **_ALIASES}


def gpu_profile(name: "str | GpuProfile | dict") -> GpuProfile:
    """The profile `name` names (key, vendor name or CUDA's device name), or one given as its fields (a dict, checked
    field by field); else `PlanError`, closest first."""
    if isinstance(name, GpuProfile):
        return name
    if isinstance(name, dict):
        return GpuProfile(**name)
    if isinstance(name, str) and name.strip().lower() in MEASURE_NAMES:
        return measure_gpu_profile()
    if not isinstance(name, str) or not name.strip():
        raise PlanError(f"gpu= takes a GPU name such as 'rtx4090'; got {name!r}. Known: {', '.join(PROFILES)}.")
    found = match_device_name(name)
    if found is not None:
        return found
    close = difflib.get_close_matches(_normalise(name), list(_BY_NORMAL), n=3, cutoff=0.5)
    keys = list(dict.fromkeys(_BY_NORMAL[c] for c in close))
    hint = f" Did you mean {' or '.join(repr(key) for key in keys)}?" if keys else ""
    raise PlanError(f"gpu={name!r} names no GPU profile this library knows.{hint} Known: "
                    f"{', '.join(PROFILES)}. For another GPU, pass link_bandwidth= for its host link; the "
                    "compute times then assume the closest profile you name.")


def match_device_name(device_name: str) -> Optional[GpuProfile]:
    """The profile for a device name as CUDA reports it, or None: exact after normalising, else the longest key
    the name contains ("NVIDIA H100 PCIe" -> h100: the same chip, its PCIe card a little slower)."""
    normal = _normalise(device_name)
    if normal in _BY_NORMAL:
        return PROFILES[_BY_NORMAL[normal]]
    contained = [key for key in _BY_NORMAL if re.search(re.escape(key) + r"(?![0-9])", normal)]  # l4 not in l40s
    if not contained:
        return None
    return PROFILES[_BY_NORMAL[max(contained, key=len)]]


def choose_gpu(gpu, accelerators) -> tuple[GpuProfile, str]:
    """The profile a plan's seconds assume, and where it came from: `gpu` as named; else this process's CUDA GPU
    the plan's first accelerator is, when the table knows it; else `DEFAULT_GPU`, assumed."""
    if gpu is not None:
        profile = gpu_profile(gpu)
        return profile, profile.source or "named (gpu=)"
    used = sorted(d for d in accelerators if is_accelerator(d))
    present = detect_accelerators()
    if used and not present.virtual and present.kind == "cuda" and used[-1] < present.count:
        name = torch.cuda.get_device_name(used[0])
        found = match_device_name(name)
        if found is not None:
            return found, f"detected: cuda:{used[0]} is {name}"
        return PROFILES[DEFAULT_GPU], (f"assumed: cuda:{used[0]} is {name!r}, which the profiles do not know; "
                                       "name the closest with gpu=")
    return PROFILES[DEFAULT_GPU], "assumed: no GPU named (gpu=) or present"


# "measured" is a measured profile's key, so a plan's recorded inputs replan on the same measurement.
MEASURE_NAMES = ("measure", "measured")
MATMUL_SIDE = 4096  # a square GEMM large enough for the tensor cores' sustained rate: 137 GFLOP, well under 1 s
COPY_BYTES = 256 * 1024**2  # device -> device copy: past every cache, at HBM/GDDR speed
MEASURE_REPEATS = 10
# Share of the peak a large square GEMM reaches (cuBLAS: 70-80%): a measured rate over it is a peak equivalent.
GEMM_EFFICIENCY = 0.75
_MEASURED: dict[int, GpuProfile] = {}


def measure_gpu_profile(index: Optional[int] = None) -> GpuProfile:
    """CUDA GPU `index` (default: the current one) measured once per process: matmul FLOP/s and device copy
    bytes/s turned into peak equivalents (`GEMM_EFFICIENCY`, `MEMORY_EFFICIENCY`), the pinned link as measured;
    fp8 and the PCIe generation from the table's row for its name."""
    if not torch.cuda.is_available():
        raise PlanError("gpu='measure' measures this machine's CUDA GPU, and torch.cuda.is_available() is False "
                        f"here; name a profile instead ({', '.join(PROFILES)}).")
    index = torch.cuda.current_device() if index is None else index
    if index not in _MEASURED:
        _MEASURED[index] = _measured(index)
    return _MEASURED[index]


# The pinned host -> GPU copy timed for the link speed (plans for this machine) and for gpu="measure".
MEASURED_BYTES = 64 * 1024**2  # large enough for the copy engine's sustained rate, small enough to be quick
REPEATS = 5


@functools.cache
def measure_cuda_link(index: int) -> Optional[float]:
    """Host -> cuda:`index` bytes/s of a pinned copy (the best of `REPEATS` after a warm-up); None without CUDA or
    room on the GPU."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    device = torch.device("cuda", index)
    try:
        host = torch.empty(MEASURED_BYTES, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(MEASURED_BYTES, dtype=torch.uint8, device=device)
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        target.copy_(host, non_blocking=True)  # warm-up: the first copy pays for mappings and clocks
        stream.synchronize()
        best = 0.0
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
            if seconds > 0:
                best = max(best, MEASURED_BYTES / seconds)
    del target, host
    return best or None


def _measured(index: int) -> GpuProfile:
    name = torch.cuda.get_device_name(index)
    known = match_device_name(name)
    device = _cuda_device(index)
    with torch.cuda.device(index):
        bf16 = _matmul_flops(device, torch.bfloat16)
        fp32 = _matmul_flops(device, torch.float32)
        memory = _copy_bytes_per_s(device)
    link = measure_cuda_link(index)
    if link is None:
        raise PlanError(f"gpu='measure' could not time a pinned host -> cuda:{index} copy (no room on the GPU?); "
                        "name a profile instead.")
    return GpuProfile(
        key="measured", name=name, bf16_tflops=bf16 / GEMM_EFFICIENCY / 1e12,
        fp8_tflops=None if known is None else known.fp8_tflops, fp32_tflops=fp32 / GEMM_EFFICIENCY / 1e12,
        memory_gb_s=memory / MEMORY_EFFICIENCY / 1e9, pcie_gen=4 if known is None else known.pcie_gen,
        measured_link_bytes_per_s=link, architecture=None if known is None else known.architecture,
        source=(f"measured: cuda:{index} is {name}; bf16 matmul {bf16 / 1e12:.0f} TFLOPS, fp32 {fp32 / 1e12:.0f}, "
                f"device copy {memory / 1e9:.0f} GB/s, pinned host -> GPU {link / 1e9:.1f} GB/s"))




def _cuda_device(index: int) -> torch.device:  # the seam tests replace to run the measurement on the CPU
    return torch.device("cuda", index)


def cuda_seconds(work, repeats: int) -> float:
    """Seconds one `work()` takes on the current stream, by CUDA events, after one warm-up call."""
    work()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def _matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device, dtype=dtype)
    b = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device, dtype=dtype)
    return 2 * MATMUL_SIDE**3 / cuda_seconds(lambda: torch.mm(a, b), MEASURE_REPEATS)


def _copy_bytes_per_s(device: torch.device) -> float:
    """Bytes read plus written per second by a device -> device copy."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / cuda_seconds(lambda: target.copy_(source), MEASURE_REPEATS)


__all__ = ["ARCHITECTURES", "choose_gpu", "COMPUTE_EFFICIENCY", "Efficiency", "invalid_fields_text", "cpu_flops_per_s", "cuda_seconds", "DEFAULT_GPU", "GpuProfile", "LINK_EFFICIENCY",
           "MEMORY_EFFICIENCY", "PROFILES", "gpu_profile", "match_device_name", "measure_gpu_profile"]
