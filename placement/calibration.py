"""`placement calibrate`'s measurements: this machine once, into a `MachineProfile` (machine_profile.py).

Per accelerator (CUDA's, or the virtual ones of PLACEMENT_VIRTUAL_ACCELERATORS, which are the CPU): pinned and
pageable host -> device copies, device memory speed, matmul / attention (SDPA) / conv throughput per dtype it
supports; the CPU's matmul and conv throughput; the checkpoint drive's read speed (a temporary file written,
evicted from the page cache and read back); host RAM. Each figure runs for about `seconds` (a warm-up first), timed
by CUDA events on a GPU and the clock elsewhere; what cannot be measured here is listed with the reason.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .devices import detect_accelerators
from .gpu_profiles import cuda_seconds
from .machine_profile import VIRTUAL_NAME, DeviceMeasurement, HostMeasurement, MachineProfile, today
from .transfers.inputs import measure_disk_read


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """The sizes timed: large enough for a device's sustained rate, small enough for `seconds` per figure."""

    matmul: int
    attention: tuple[int, int, int]  # heads, tokens, head dim (batch 1)
    conv: tuple[int, int]  # channels, side (3x3, batch 1)
    copy_bytes: int
    disk_bytes: int


GPU_SHAPES = Shapes(matmul=8192, attention=(24, 4096, 128), conv=(512, 128), copy_bytes=256 * 2**20,
                    disk_bytes=1024 * 2**20)
CPU_SHAPES = Shapes(matmul=1024, attention=(8, 1024, 64), conv=(64, 64), copy_bytes=64 * 2**20,
                    disk_bytes=256 * 2**20)
GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CPU_DTYPES = (torch.float32, torch.bfloat16)


def calibrate(*, disk_folder: Optional[Path] = None, seconds: float = 1.0, say: Callable[[str], None] = print,
              shapes: Optional[Shapes] = None) -> MachineProfile:
    """Measure this machine; `disk_folder`: where the read speed is timed (default: the profile's cache folder).
    `say` is told each figure as it is measured."""
    from .machine_profile import profile_path

    not_measured: list[str] = []
    host = _host(disk_folder or profile_path().parent, seconds, say, not_measured, shapes or CPU_SHAPES)
    present = detect_accelerators()
    gpus: list[DeviceMeasurement] = []
    if present.count == 0:
        not_measured.append("every GPU figure (host -> GPU copies, GPU matmul/attention/conv): no CUDA GPU "
                            "(torch.cuda.is_available() is False) and no PLACEMENT_VIRTUAL_ACCELERATORS")
    elif present.kind not in ("cuda", "vgpu", "cpu"):
        not_measured.append(f"the {present.kind} devices: only CUDA GPUs are measured")
    else:
        for index in range(present.count):
            if present.virtual and gpus:  # every virtual accelerator is the same CPU: measured once
                gpus.append(gpus[0].model_copy(update={"index": index}))
                continue
            gpus.append(_accelerator(index, present, seconds, say, not_measured, shapes))
    return MachineProfile(measured_on=today(), host=host, gpus=gpus, not_measured=not_measured)


def _host(folder: Path, seconds: float, say, not_measured: list[str], shapes: Shapes) -> HostMeasurement:
    cpu = torch.device("cpu")
    matmul = {_name(dtype): _matmul(cpu, dtype, shapes.matmul, seconds) for dtype in CPU_DTYPES}
    conv = {_name(torch.float32): _conv(cpu, torch.float32, shapes.conv, seconds)}
    for dtype, rate in matmul.items():
        say(f"CPU matmul {dtype}: {rate / 1e9:.1f} GFLOP/s")
    say(f"CPU conv float32: {conv['float32'] / 1e9:.1f} GFLOP/s")
    disk = _disk(folder, shapes.disk_bytes, not_measured)
    if disk is not None:
        say(f"disk read ({folder}): {disk / 1e9:.2f} GB/s")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    say(f"host RAM: {ram / 2**30:.1f} GiB")
    return HostMeasurement(cpu=_cpu_name(), cores=os.cpu_count() or 1, ram_bytes=ram, matmul_flops=matmul,
                           conv_flops=conv, disk_read_bytes_per_s=disk, disk_folder=str(folder))


def _accelerator(index: int, present, seconds: float, say, not_measured: list[str],
                 shapes: Optional[Shapes]) -> DeviceMeasurement:
    device = present.torch_device(index)
    cuda = device.type == "cuda"
    shapes = shapes or (GPU_SHAPES if cuda else CPU_SHAPES)
    name = torch.cuda.get_device_name(index) if cuda else VIRTUAL_NAME
    label = f"{device} ({name})"
    with torch.cuda.device(index) if cuda else _nothing():
        pinned = _copy_in(device, shapes.copy_bytes, seconds, pinned=True)
        pageable = _copy_in(device, shapes.copy_bytes, seconds, pinned=False)
        memory = _device_copy(device, shapes.copy_bytes, seconds)
        dtypes = GPU_DTYPES if cuda else CPU_DTYPES
        matmul = {_name(d): _matmul(device, d, shapes.matmul, seconds) for d in dtypes}
        attention = {_name(d): _attention(device, d, shapes.attention, seconds) for d in dtypes}
        conv = {_name(d): _conv(device, d, shapes.conv, seconds) for d in dtypes}
        fp8 = _fp8_matmul(device, shapes.matmul, seconds, not_measured, label)
    if fp8 is not None:
        matmul["float8_e4m3fn"] = fp8
    say(f"{label}: host -> device pinned {pinned / 1e9:.2f} GB/s, pageable {pageable / 1e9:.2f} GB/s, "
        f"device memory {memory / 1e9:.1f} GB/s")
    for what, rates in (("matmul", matmul), ("attention", attention), ("conv", conv)):
        say(f"{label}: {what} " + ", ".join(f"{d} {r / 1e12:.3g} TFLOP/s" for d, r in rates.items()))
    return DeviceMeasurement(index=index, name=name, kind=device.type, pinned_copy_bytes_per_s=pinned,
                             pageable_copy_bytes_per_s=pageable, memory_bytes_per_s=memory, matmul_flops=matmul,
                             attention_flops=attention, conv_flops=conv)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _per_second(work: Callable[[], object], amount: float, device: torch.device, seconds: float) -> float:
    """`amount` (FLOPs or bytes) per `work()`, divided by its mean seconds over about `seconds` after a warm-up;
    CUDA events on a GPU (the work is queued), the clock elsewhere."""
    work()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if cuda:
        torch.cuda.synchronize(device)
    once = max(time.perf_counter() - start, 1e-6)
    repeats = max(2, min(1000, int(seconds / once)))
    if cuda:
        elapsed = cuda_seconds(work, repeats) * repeats
    else:
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        elapsed = time.perf_counter() - start
    return amount * repeats / max(elapsed, 1e-9)


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Normal values made where they are used on CUDA (fast); on the CPU and moved elsewhere (a virtual device
    draws from no generator of its own)."""
    if device.type == "cuda":
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype).to(device)


def _matmul(device: torch.device, dtype: torch.dtype, side: int, seconds: float) -> float:
    a, b = _random((side, side), dtype, device), _random((side, side), dtype, device)
    return _per_second(lambda: torch.mm(a, b), 2 * side**3, device, seconds)


def _attention(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], seconds: float) -> float:
    heads, tokens, dim = shape
    q, k, v = (_random((1, heads, tokens, dim), dtype, device) for _ in range(3))
    flops = 4 * heads * tokens * tokens * dim  # Q K^T and P V
    return _per_second(lambda: F.scaled_dot_product_attention(q, k, v), flops, device, seconds)


def _conv(device: torch.device, dtype: torch.dtype, shape: tuple[int, int], seconds: float) -> float:
    channels, side = shape
    x = _random((1, channels, side, side), dtype, device)
    weight = _random((channels, channels, 3, 3), dtype, device)
    flops = 2 * channels * channels * 9 * side * side
    return _per_second(lambda: F.conv2d(x, weight, padding=1), flops, device, seconds)


def _copy_in(device: torch.device, nbytes: int, seconds: float, *, pinned: bool) -> float:
    """Host -> `device` bytes/s from pinned or pageable memory."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8).to(device)
    return _per_second(lambda: target.copy_(source, non_blocking=pinned), nbytes, device, seconds)


def _device_copy(device: torch.device, nbytes: int, seconds: float) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8).to(device)
    target = torch.empty(nbytes, dtype=torch.uint8).to(device)
    return _per_second(lambda: target.copy_(source), 2 * nbytes, device, seconds)


def _fp8_matmul(device: torch.device, side: int, seconds: float, not_measured: list[str],
                label: str) -> Optional[float]:
    """fp8 (e4m3) matmul FLOP/s through `torch._scaled_mm`, where the GPU has fp8 tensor cores (sm 8.9+)."""
    if device.type != "cuda":
        not_measured.append(f"fp8 matmul on {label}: virtual accelerators compute on the CPU, which has no fp8 "
                            "tensor cores")
        return None
    if torch.cuda.get_device_capability(device) < (8, 9):
        not_measured.append(f"fp8 matmul on {label}: needs compute capability 8.9+ (Ada, Hopper, Blackwell)")
        return None
    try:
        a = torch.randn(side, side, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(side, side, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return _per_second(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                           2 * side**3, device, seconds)
    except (RuntimeError, TypeError) as error:
        not_measured.append(f"fp8 matmul on {label}: torch._scaled_mm failed ({str(error).splitlines()[0]})")
        return None


def _disk(folder: Path, nbytes: int, not_measured: list[str]) -> Optional[float]:
    """Read speed of a temporary `nbytes` file written into `folder`, evicted from the page cache first (a read
    faster than a drive is reported as such: the page cache kept it)."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, path = tempfile.mkstemp(prefix=".placement-disk-read-", dir=folder)
    try:
        chunk = os.urandom(8 * 2**20)
        with os.fdopen(handle, "wb") as file:
            for _ in range(max(1, nbytes // len(chunk))):
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        speed, source = measure_disk_read(path)
        if "page cache" in source:
            not_measured.append(f"the drive's read speed in {folder}: the page cache served the read ({source}); "
                                "the figure kept is the cached read's")
        return speed
    finally:
        os.unlink(path)


__all__ = ["CPU_SHAPES", "GPU_SHAPES", "Shapes", "calibrate"]
