"""Seconds per call (docs/design.md, "Seconds, not only bytes"): per component, a roofline of its compute, its
copies at the link's speed (disk-homed ones at no more than the disk's), and the part of the copies compute does
not hide, as the runtime moves them: per-call loads exposed whole, streamed blocks interleaved with the kept ones.
Components run one after another, so a call's seconds are their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .cost import copy_bandwidth, exposed_copy_seconds, stream_links
from .gpu_profiles import DEFAULT_GPU, PROFILES, GpuProfile, compute_dtype, cpu_flops_per_s
from .rates import DISK_BYTES_PER_S, ERROR_BAND

if TYPE_CHECKING:  # the plan's records, read only (plan_schema imports this module for its derived fields)
    from .plan_records import ComponentPlan
    from .plan_schema import Plan

# The rules `pricing.price` applies beyond the profile's rates, each fitted to benchmarks/data/published_runs.csv
# (benchmarks/published_runs.py prints the rows and how each is predicted):
# attention kernels' speed relative to eager SDPA (FlashAttention-2 on CUDA); FA3 and SageAttention run ~1.6x FA2 on
# Hopper (the FA3 paper's bf16 figures), capped at the matmul efficiency.
ATTENTION_BACKENDS = {"sdpa": 1.0, "flash2": 1.0, "flash3": 1.6, "sage": 1.6}
# torch.compile's speedup of a whole forward (fused norms, RoPE and modulation): Wan 2.1 14B on an H100, 4.60 s
# eager vs 3.77 s compiled (diffusers PR 11605).
COMPILED_SPEEDUP = 1.22
# A pageable (not page-locked) host -> GPU copy goes through the driver's bounce buffer: this share of the pinned
# rate (diffusers' group offload without streams moved FLUX.1-dev's transformer at ~14 GB/s on an H100).
PAGEABLE_SHARE = 0.36
# Pinning host memory when a block is loaded (diffusers' group offload with `low_cpu_mem_usage=True`: each onload
# page-locks a fresh copy of the block, `tensor.pin_memory()`) is host work on the thread that launches the kernels,
# so compute does not hide it: FLUX.1-dev's transformer (23.8 GB) with block-level offload took 7.614 s per forward
# pinned per onload against 1.950 s pinned ahead on the same machine (diffusers PR 11106): 5.66 s per 23.8 GB.
# (Leaf-level groups paid 0.85 s there: many small pins interleave with the GPU's queued work; the rule prices the
# block-level case, the one an offloading plan uses.)
PIN_BYTES_PER_S = 4.2e9
# Moving a component back to pageable host RAM (diffusers' model offload after each component) writes new pages.
HOST_WRITE_BYTES_PER_S = 2.5e9
# Fixed seconds per tensor copied synchronously by a module's `.to()` (launch, allocation): FLUX's VAE moved whole
# on an H100 (0.152 s against 0.130 s resident for 0.17 GB).
TENSOR_COPY_S = 50e-6
# Fixed seconds per tensor accelerate's sequential offload pays at every run (its per-module hook moves each tensor
# with set_module_tensor_to_device, synchronously): FLUX.1-dev on an H100 took 68.4 s sequential against 47.7 s
# for the same bytes in diffusers' block offload (28 steps x 1160 tensors).
HOOK_TENSOR_S = 0.6e-3
# Fixed seconds per streamed block a prefetching runtime waits on, by runtime: module hooks that synchronize the
# copy stream from the host leave the GPU idle while the host launches the block's kernels (diffusers' group offload
# with streams exposes 0.32 s per 40-block Wan forward on an H100 where the copies themselves hide); a runtime that
# only orders streams on the device (SGLang's layerwise offload; this library's streaming waits on events, so a
# plan's `seconds_per_call` prices its blocks as "engine") pays nothing measurable.
BLOCK_SYNC_S = {"hooks": 5.5e-3, "engine": 0.0}
OVERLAP_MODEL = ("per-call loads exposed whole; streamed blocks interleaved with the kept ones and sent when the "
                 "streamed block before them starts, each copy hidden by the compute since then")


@dataclass(frozen=True, kw_only=True)
class ComponentTime:
    """One component's seconds per call; `compute_s` is None when its FLOPs are not known."""

    name: str
    runs: int
    compute_s: Optional[float]
    copy_s: float
    exposed_s: float
    on_cpu: bool = False

    @property
    def total_s(self) -> float:
        return (self.compute_s or 0.0) + self.exposed_s


@dataclass(frozen=True, kw_only=True)
class CallTime:
    """A plan's seconds per call on `gpu`, per component in execution order."""

    gpu: GpuProfile
    link_bandwidth: float
    components: tuple[ComponentTime, ...]

    @property
    def compute_s(self) -> float:
        return sum(c.compute_s or 0.0 for c in self.components)

    @property
    def copy_s(self) -> float:
        return sum(c.copy_s for c in self.components)

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed_s for c in self.components)

    @property
    def seconds(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def uncounted(self) -> list[str]:
        """Components whose compute is not known (no FLOPs: planned without a call, or a plan before v4)."""
        return [c.name for c in self.components if c.compute_s is None]

    @property
    def device(self) -> str:
        """What runs the call: the GPU, "the CPU" when every component computes there, or the GPU with the
        components the CPU computes named ("RTX 4090 (text_encoder on the CPU)")."""
        on_cpu = [c.name for c in self.components if c.on_cpu]
        if on_cpu and len(on_cpu) == len(self.components):
            return "the CPU"
        return short_name(self.gpu) + (f" ({', '.join(on_cpu)} on the CPU)" if on_cpu else "")

    def summary(self) -> str:
        """"about 14 s per call on RTX 4090, +-15%: compute 13.6 s, copies 0.9 s of which 0.3 s exposed" (the band:
        `ERROR_BAND`, what the model misses published runs by)."""
        text = (f"about {seconds_text(self.seconds)} per call on {self.device}, +-{ERROR_BAND:.0%}: compute "
                f"{seconds_text(self.compute_s)}")
        if self.copy_s:
            text += f", copies {seconds_text(self.copy_s)} of which {seconds_text(self.exposed_s)} exposed"
        if self.uncounted:
            text += f" (compute of {', '.join(self.uncounted)} not known)"
        return text


def run_seconds(flops: Optional[int], bytes_touched: Optional[int], gpu: GpuProfile, dtype: Optional[str], *,
                on_cpu: bool = False) -> Optional[float]:
    """Seconds of one run: max(FLOPs / FLOP/s, bytes touched / memory bandwidth) on `gpu`; on the CPU at this
    machine's measured rate in the component's dtype (`cpu_flops_per_s`); None without FLOPs."""
    if flops is None:
        return None
    if on_cpu:
        return flops / (gpu.cpu_flops or cpu_flops_per_s(compute_dtype(dtype) or "float32"))
    memory = (bytes_touched or 0) / gpu.memory_bytes_per_s
    return max(flops / gpu.flops_per_s(dtype), memory)


def host_copy_rate(link: float, pinned_share: float = 1.0, pageable: Optional[float] = None) -> float:
    """Host -> GPU bytes/s of copies whose `pinned_share` comes from page-locked memory at `link` and the rest
    from pageable memory at `pageable` (default `PAGEABLE_SHARE` of the link; never above it): the bytes are
    alike, so each copy is that mix and its seconds per byte add."""
    pageable = min(link, link * PAGEABLE_SHARE if pageable is None else pageable)
    if pinned_share >= 1.0:
        return link
    share = max(0.0, pinned_share)
    return 1 / (share / link + (1 - share) / pageable)


def plan_copy_rate(plan: Plan, gpu: GpuProfile) -> float:
    """The host -> GPU bytes/s a plan's copies run at: its link, with the share of the moving bytes its "cpu"
    budget cannot page-lock (`host_memory.HostMemory.pinned_share`) at the pageable rate (the profile's measured
    one, where `placement calibrate` measured it)."""
    return host_copy_rate(plan.link_bandwidth, plan.host_memory.pinned_share,
                          gpu.measured_pageable_link_bytes_per_s)


def component_time(component: ComponentPlan, gpu: GpuProfile, link: float,
                   disk: float = DISK_BYTES_PER_S) -> ComponentTime:
    """`component`'s seconds per call on `gpu`, the link and the disk reading `link` and `disk` bytes/s."""
    transfer = component.transfer
    runs = 1 if transfer is None else transfer.runs_per_call
    on_cpu = component.execution_device == "cpu"
    run_s = run_seconds(component.flops_per_run, component.bytes_touched_per_run, gpu, component.dtype,
                        on_cpu=on_cpu)
    if transfer is None or on_cpu or not transfer.bytes_per_call:
        return ComponentTime(name=component.name, runs=runs, compute_s=None if run_s is None else runs * run_s,
                             copy_s=0.0, exposed_s=0.0, on_cpu=on_cpu)
    speed = copy_bandwidth(component.kind, link, disk)
    exposed = exposed_copy_seconds(
        run_s=run_s or 0.0, weight_bytes=component.bytes, loaded_bytes=transfer.loaded_per_call_bytes,
        streamed_bytes=transfer.streamed_per_run_bytes, streamed_blocks=len(transfer.streamed_modules),
        runs=runs, link=speed, links=stream_links(transfer.streamed_devices))
    return ComponentTime(name=component.name, runs=runs, compute_s=None if run_s is None else runs * run_s,
                         copy_s=transfer.bytes_per_call / speed, exposed_s=exposed)


def plan_time(plan: Plan, gpu: Optional[GpuProfile] = None) -> CallTime:
    """The plan's seconds per call on `gpu` (default: the plan's profile; a file before v4 has none: the default),
    its copies at `plan_copy_rate` (what its host budget cannot pin copies at the pageable rate)."""
    gpu = gpu or plan.gpu or PROFILES[DEFAULT_GPU]
    link = plan_copy_rate(plan, gpu)
    return CallTime(gpu=gpu, link_bandwidth=link,
                    components=tuple(component_time(c, gpu, link, plan.disk_read_bandwidth)
                                     for c in plan.components.values()))


def time_line(plan: Plan) -> Optional[str]:
    """"Predicted: about 14 s per call on RTX 4090: compute 13.6 s, copies 0.9 s of which 0.3 s exposed (named
    (gpu=))."; None when no component's FLOPs are known (a plan without a call: only bytes are known)."""
    if plan.seconds_per_call is None:
        return None
    time = plan.time_per_call()
    return f"Predicted: {time.summary()} ({plan.gpu_source})."


def short_name(gpu: GpuProfile) -> str:
    """"NVIDIA GeForce RTX 4090" -> "RTX 4090"."""
    return gpu.name.replace("NVIDIA GeForce ", "").replace("NVIDIA ", "").replace("AMD Instinct ", "")


def seconds_text(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.2g} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"
