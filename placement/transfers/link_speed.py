"""The host -> accelerator link speed that turns a plan's bytes per call into seconds.

Given (`placement.plan(link_bandwidth=...)`): as given. Otherwise, when the plan moves weights per call and
every accelerator it uses is a CUDA GPU of this process, measured: a timed copy of pinned host memory to the
first of them (what per-call loads and streamed blocks are: pinned host -> GPU copies), the best of a few,
once per process and GPU. Else (no GPU here: planning on a CPU machine, virtual accelerators, a plan for other
hardware) PCIe 4.0 x16's sustained 25 GB/s, assumed, and the plan's `link_bandwidth_source` says so.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional

import torch

from ..devices import detect_accelerators, is_accelerator

MEASURED_BYTES = 64 * 1024**2  # large enough for the copy engine's sustained rate, small enough to be quick
REPEATS = 5


def link_speed(devices: Iterable, *, moves: bool) -> Optional[tuple[float, str]]:
    """(bytes/s, where the number comes from) measured for a plan using `devices` that moves weights per call
    (`moves`), or None: the default is assumed (see the module docstring)."""
    accelerators = sorted(d for d in devices if is_accelerator(d))
    if not moves or not accelerators:
        return None
    present = detect_accelerators()
    if present.virtual or present.kind != "cuda" or accelerators[-1] >= present.count:
        return None
    measured = measure_cuda_link(accelerators[0])
    if measured is None:
        return None
    return measured, f"measured: pinned host -> cuda:{accelerators[0]}, {MEASURED_BYTES // 1024**2} MiB copy"


@functools.cache
def measure_cuda_link(index: int) -> Optional[float]:
    """Host -> cuda:`index` bytes/s of a pinned copy of `MEASURED_BYTES` (the best of `REPEATS`, after a warm-up
    copy); None without CUDA or when the copy cannot be made (no room on the GPU)."""
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


__all__ = ["MEASURED_BYTES", "link_speed", "measure_cuda_link"]
