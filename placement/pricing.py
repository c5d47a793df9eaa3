"""`placement.price`: the seconds of a placement you name, not only the one the planner chose.

Give each component's work per run (`ComponentWork`: its weights, blocks and FLOPs split into matmul, attention and
convolution), a GPU profile, and per component how it is placed (`Mode`: resident, whole-component offload,
sequential offload, block offload with or without a prefetch stream, N blocks resident with prefetch depth P, pinned
or pageable host memory, compiled or eager, the attention backend). `price` returns a `time_model.CallTime`: per
component its compute, its copies, the part of them compute does not hide and the fixed costs, in seconds.

The rules are `time_model`'s (its constants are stated and fitted to benchmarks/data/published_runs.csv):
- compute: matmul, attention and convolution FLOPs each at their share of the peak for the chip's architecture
  (`gpu_profiles.ARCHITECTURES`), the attention backend's and torch.compile's factors; never faster than the bytes
  it touches at the memory's speed;
- copies: pinned at the link's sustained rate, pageable at `PAGEABLE_SHARE` of it or at the profile's measured
  pageable rate (a pinned-memory budget smaller than the weights, `Mode.pinned_bytes`: that share of every copy
  pinned, the rest pageable: `time_model.host_copy_rate`, the planner's rule too); pinning per onload
  (`Mode.pin_per_onload`) copies at the pinned rate but first page-locks the bytes on the host at
  `PIN_BYTES_PER_S`, exposed whole (the launching thread does it, so compute cannot hide it); a fixed `TENSOR_COPY_S` per
  tensor copied synchronously (a module's `.to()`; `HOOK_TENSOR_S` through accelerate's per-module hooks) and
  `BLOCK_SYNC_S` per block a prefetching runtime waits on; offloading a component back to pageable host memory at `HOST_WRITE_BYTES_PER_S`;
- overlap: one copy stream, blocks in order, a block's copy starting once the one before it is copied and a slot
  of the prefetch depth is free (`streamed_run_seconds`); a video VAE's streamed weights paid once per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from .errors import PlanError
from .gpu_profiles import GpuProfile, gpu_profile
from .time_model import (ATTENTION_BACKENDS, BLOCK_SYNC_S, COMPILED_SPEEDUP, DISK_BYTES_PER_S, HOOK_TENSOR_S,
                         HOST_WRITE_BYTES_PER_S, PIN_BYTES_PER_S, TENSOR_COPY_S, CallTime, ComponentTime,
                         host_copy_rate)

MODES = ("resident", "model_offload", "sequential", "group", "group_streams", "layerwise")


@dataclass(frozen=True, kw_only=True)
class ComponentWork:
    """What one run of a component does. `blocks`: its repeated blocks (a DiT's layers) holding `block_bytes` of
    `weight_bytes` (default: all of them); `tensors` the weight tensors (a synchronous copy pays each); `chunks` the
    passes one run makes over its weights (a video VAE: temporal chunks x tiles). FLOPs are per run."""

    name: str
    weight_bytes: int
    matmul_flops: float = 0.0
    fp32_flops: float = 0.0  # matmuls kept in float32 (`_keep_in_fp32_modules`, e.g. T5's `wo`): the fp32 peak
    attention_flops: float = 0.0
    conv_flops: float = 0.0
    bytes_touched: float = 0.0
    runs: int = 1
    blocks: int = 1
    block_bytes: Optional[int] = None
    tensors: int = 1
    chunks: int = 1

    def __post_init__(self):
        for name in ("weight_bytes", "matmul_flops", "fp32_flops", "attention_flops", "conv_flops", "bytes_touched"):
            _check_number(f"{self.name}.{name}", getattr(self, name), minimum=0.0)
        for name in ("runs", "blocks", "tensors", "chunks"):
            _check_count(f"{self.name}.{name}", getattr(self, name))
        if self.block_bytes is not None:
            _check_number(f"{self.name}.block_bytes", self.block_bytes, minimum=0.0)
            if self.block_bytes > self.weight_bytes:
                raise PlanError(f"ComponentWork {self.name!r}: block_bytes={self.block_bytes} exceeds weight_bytes="
                                f"{self.weight_bytes}; the blocks are part of the weights.")

    @property
    def streamed_bytes(self) -> int:
        return self.weight_bytes if self.block_bytes is None else self.block_bytes


@dataclass(frozen=True, kw_only=True)
class Mode:
    """How a component is placed and run. `kind`: "resident"; "model_offload" (moved whole before each call, as
    diffusers' `enable_model_cpu_offload`, which also moves it back to host RAM: `back_to_host`); "sequential"
    (every tensor at every run, synchronously, as `enable_sequential_cpu_offload`); "group" (every block at every
    run, synchronously, as `enable_group_offload` without streams); "group_streams" (the same with the next block
    prefetched on a side stream); "layerwise" (`resident_blocks` leading blocks kept, the rest streamed with
    `prefetch` blocks in flight, the non-block rest resident, as SGLang's layerwise offload and our streaming).
    `pinned`: host memory is page-locked (else pageable); `pinned_bytes`: with `pinned`, how many of the
    component's weight bytes the host could page-lock (None: all; the rest copy at the pageable rate);
    `pin_per_onload`: weights rest pageable and each load page-locks its bytes first (diffusers'
    `low_cpu_mem_usage=True`); `home`: "cpu" or "disk" (read at the disk's speed);
    `runtime`: what waits on each streamed block (`time_model.BLOCK_SYNC_S`): "hooks" (module hooks that sync the
    copy stream from the host, as diffusers' group offload) or "engine" (copies ordered by events on the device,
    the host never blocked: SGLang's layerwise offload, and this library's streaming, hooks/group_offload/
    transfer.py)."""

    kind: str = "resident"
    resident_blocks: int = 0
    prefetch: int = 1
    pinned: bool = True
    pinned_bytes: Optional[int] = None
    pin_per_onload: bool = False
    back_to_host: bool = False
    compiled: bool = False
    attention: str = "sdpa"
    home: str = "cpu"
    runtime: str = "hooks"

    def __post_init__(self):
        if self.kind not in MODES:
            raise PlanError(f"Mode kind={self.kind!r} is not one of {', '.join(MODES)}.")
        if self.attention not in ATTENTION_BACKENDS:
            raise PlanError(f"Mode attention={self.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}.")
        if self.runtime not in BLOCK_SYNC_S:
            raise PlanError(f"Mode runtime={self.runtime!r} is not one of {', '.join(BLOCK_SYNC_S)}.")
        if self.home not in ("cpu", "disk"):
            raise PlanError(f"Mode home={self.home!r}: weights off the GPU live on 'cpu' or 'disk'.")
        if isinstance(self.resident_blocks, bool) or not isinstance(self.resident_blocks, int) \
                or self.resident_blocks < 0:
            raise PlanError(f"Mode resident_blocks={self.resident_blocks!r} must be an int >= 0.")
        _check_count("Mode.prefetch", self.prefetch)
        if self.pinned_bytes is not None:
            if isinstance(self.pinned_bytes, bool) or not isinstance(self.pinned_bytes, int) or self.pinned_bytes < 0:
                raise PlanError(f"Mode pinned_bytes={self.pinned_bytes!r} must be an int >= 0 (None: all pinned).")
            if not self.pinned or self.pin_per_onload:
                raise PlanError("Mode pinned_bytes is the page-locked share of weights pinned ahead: it needs "
                                "pinned=True and pin_per_onload=False.")


def price(components: Sequence[ComponentWork], gpu: Union[str, GpuProfile, dict],
          modes: Optional[Mapping[str, Union[Mode, str]]] = None, *, link_bandwidth: Optional[float] = None,
          disk_read_bandwidth: Optional[float] = None) -> CallTime:
    """Predicted seconds of one call of `components` (in execution order) on `gpu`, each placed as `modes` says
    (a `Mode` or its kind; components not named are resident). `link_bandwidth`: pinned host -> GPU bytes/s
    (default: the profile's); `disk_read_bandwidth`: bytes/s for disk-homed weights."""
    profile = gpu_profile(gpu)
    link = profile.link_bytes_per_s if link_bandwidth is None else link_bandwidth
    _check_number("link_bandwidth", link, minimum=0.0, strict=True)
    disk = DISK_BYTES_PER_S if disk_read_bandwidth is None else disk_read_bandwidth
    _check_number("disk_read_bandwidth", disk, minimum=0.0, strict=True)
    # A measured pageable rate belongs to the measured link; a link given here keeps `PAGEABLE_SHARE` of it.
    pageable = profile.measured_pageable_link_bytes_per_s if link_bandwidth is None else None
    modes = dict(modes or {})
    unknown = sorted(set(modes) - {c.name for c in components})
    if unknown:
        raise PlanError(f"price(): modes name {', '.join(map(repr, unknown))}, which are not among the components "
                        f"({', '.join(c.name for c in components)}).")
    timed = []
    for work in components:
        mode = modes.get(work.name, Mode())
        timed.append(component_price(work, profile, Mode(kind=mode) if isinstance(mode, str) else mode, link, disk,
                                     pageable))
    return CallTime(gpu=profile, link_bandwidth=link, components=tuple(timed))


def compute_seconds(work: ComponentWork, gpu: GpuProfile, mode: Mode) -> float:
    """One run's compute: each kind of FLOPs at its rate (module doc), no faster than reading its weights and the
    bytes it touches at the memory's speed."""
    efficiency, peak = gpu.efficiency, gpu.peak_flops("bfloat16")
    speedup = COMPILED_SPEEDUP if mode.compiled else 1.0
    attention = min(efficiency.attention * ATTENTION_BACKENDS[mode.attention], efficiency.matmul)
    fp32 = gpu.peak_flops("float32") * efficiency.matmul
    seconds = (work.matmul_flops / (peak * efficiency.matmul) + work.fp32_flops / fp32
               + work.attention_flops / (peak * attention) + work.conv_flops / (peak * efficiency.conv)) / speedup
    return max(seconds, max(work.bytes_touched, work.weight_bytes) / gpu.memory_bytes_per_s)  # reads every weight


def component_price(work: ComponentWork, gpu: GpuProfile, mode: Mode, link: float, disk: float,
                    pageable: Optional[float] = None) -> ComponentTime:
    """`work`'s seconds per call placed as `mode` (module doc); `pageable`: the pageable copies' bytes/s (None:
    `PAGEABLE_SHARE` of the link)."""
    run_s = compute_seconds(work, gpu, mode)
    speed = copy_bytes_per_s(work, mode, link, disk, pageable)
    pin = 1 / PIN_BYTES_PER_S if mode.pin_per_onload else 0.0  # host seconds per byte, exposed whole
    compute = work.runs * run_s
    if mode.kind == "resident":
        return _timed(work, compute, 0.0, 0.0)
    if mode.kind == "model_offload":
        copy = work.weight_bytes * (1 / speed + pin) + work.tensors * TENSOR_COPY_S
        back = work.weight_bytes / HOST_WRITE_BYTES_PER_S if mode.back_to_host else 0.0
        return _timed(work, compute, copy + back, copy + back)
    if mode.kind in ("sequential", "group"):  # every weight (the blocks and the rest's group) at every pass
        passes = work.runs * work.chunks
        per_tensor = HOOK_TENSOR_S if mode.kind == "sequential" else TENSOR_COPY_S
        copy = passes * (work.weight_bytes * (1 / speed + pin) + work.tensors * per_tensor)
        return _timed(work, compute, copy, copy)
    layerwise = mode.kind == "layerwise"  # its non-block rest stays resident; group offload moves it as a group too
    streamed = work.blocks - (mode.resident_blocks if layerwise else 0)
    if streamed <= 0:
        return _timed(work, compute, 0.0, 0.0)
    block_bytes = (work.streamed_bytes if layerwise else work.weight_bytes) / work.blocks
    block_copy = block_bytes / speed
    per_pass = streamed_run_seconds(run_s / work.chunks, blocks=work.blocks, streamed=streamed,
                                    block_copy=block_copy, prefetch=mode.prefetch,
                                    leading_resident=layerwise, sync=BLOCK_SYNC_S[mode.runtime])
    pinning = work.runs * work.chunks * streamed * block_bytes * pin
    copy = work.runs * work.chunks * streamed * block_copy + pinning
    exposed = round(work.runs * work.chunks * per_pass - compute, 9)  # to the nanosecond: float noise is not time
    return _timed(work, compute, copy, max(0.0, exposed) + pinning)


def copy_bytes_per_s(work: ComponentWork, mode: Mode, link: float, disk: float,
                     pageable: Optional[float] = None) -> float:
    """The host -> GPU rate of `work`'s copies placed as `mode`: pinned (ahead or per onload) at the link's rate,
    pageable at `pageable` (default `PAGEABLE_SHARE` of the link); a pinned budget short of the weights pins that
    share of every copy (the blocks are alike, so each is as pinned as the whole) and pays the pageable rate for
    the rest (`time_model.host_copy_rate`, the planner's rule too); disk-homed weights at no more than the disk's
    rate."""
    if mode.pin_per_onload:
        share = 1.0
    elif not mode.pinned:
        share = 0.0
    elif mode.pinned_bytes is None or not work.weight_bytes:
        share = 1.0
    else:
        share = mode.pinned_bytes / work.weight_bytes
    speed = host_copy_rate(link, share, pageable)
    return min(speed, disk) if mode.home == "disk" else speed


def streamed_run_seconds(run_s: float, *, blocks: int, streamed: int, block_copy: float, prefetch: int,
                         leading_resident: bool, sync: float = 0.0) -> float:
    """Seconds of one pass over `blocks` equal blocks computing `run_s` in all, `streamed` of them copied in on one
    copy stream (the last ones when `leading_resident`, else every block), each copy `block_copy` seconds, started
    once the copy before it is done and a slot of `prefetch` blocks ahead is free; a streamed block's compute waits
    for its copy and pays `sync` (`BLOCK_SYNC_S` of its runtime). The first copy starts with the pass (a run
    starts cold)."""
    compute = run_s / blocks
    first_streamed = blocks - streamed if leading_resident else 0
    done, copy_done, started = 0.0, 0.0, []
    for index in range(blocks):
        if index < first_streamed:
            started.append(done)
            done += compute
            continue
        ahead = index - prefetch  # its copy waits for that block to start: `prefetch` blocks in flight at most
        slot_free = started[ahead] if ahead >= 0 else 0.0
        copy_done = max(copy_done, slot_free) + block_copy
        start = max(done, copy_done) + sync
        started.append(start)
        done = start + compute
    return done


def _timed(work: ComponentWork, compute: float, copy: float, exposed: float) -> ComponentTime:
    return ComponentTime(name=work.name, runs=work.runs, compute_s=compute, copy_s=copy, exposed_s=exposed)


def _check_number(name: str, value, *, minimum: float, strict: bool = False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < minimum or (strict and value <= minimum):
        need = "a positive" if strict else "a non-negative"
        raise PlanError(f"{name}={value!r} must be {need} finite number.")


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be an int >= 1.")


__all__ = ["ComponentWork", "MODES", "Mode", "compute_seconds", "copy_bytes_per_s", "price", "streamed_run_seconds"]
