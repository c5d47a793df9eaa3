"""The transfer and time model's inputs to `placement.plan`, checked: `runs_per_call`, FLOPs per run, and the
copy speeds: the link (given, else measured with pinned host -> GPU copies when the plan moves weights to this
process's CUDA GPUs, else PCIe 4.0's 25 GB/s) and the disk read (given, else measured once per drive with the
file's cached pages dropped, else NVMe's, assumed: drives span two orders of magnitude).
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Mapping, Optional

from ..devices import detect_accelerators, is_accelerator
from ..errors import PlanError
from ..gpu_profiles import MEASURED_BYTES, measure_cuda_link
from ..plan_schema import DEFAULT_LINK_BANDWIDTH
from ..sizes import parse_size
from ..rates import DISK_BYTES_PER_S


def component_mapping(values: Optional[Mapping], modules: Mapping, argument: str, shape: str) -> dict:
    """`values` as given to `placement.plan` under `argument` (None: {}), checked to be a dict whose keys are all
    module components; `shape` says what the dict looks like in the error."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise PlanError(f"{argument} must be a dict {shape}, got {values!r}.")
    unknown = [name for name in values if name not in modules]
    if unknown:
        raise PlanError(
            f"{argument} names components that do not exist: {unknown}. The module components are "
            f"{list(modules)}."
        )
    return dict(values)


def check_runs_per_call(runs_per_call: Optional[Mapping], modules: Mapping) -> dict[str, int]:
    """`{component: runs}` as given, every name a module component and every value a positive int."""
    runs = component_mapping(runs_per_call, modules, "runs_per_call",
                             "{component: runs per call} such as {'transformer': 28}")
    bad = {name: count for name, count in runs.items()
           if isinstance(count, bool) or not isinstance(count, int) or count < 1}
    if bad:
        raise PlanError(
            f"runs_per_call values must be ints >= 1 (how many times the component runs per pipeline call, e.g. "
            f"28 denoising steps, or 56 where guidance runs as a second pass); got {bad}."
        )
    return runs


def check_per_run(values, modules, argument: str) -> dict[str, int]:
    """`{component: count}` as given to `placement.plan` (`flops_per_run=`, `bytes_touched_per_run=`): every
    name a module component, every value an int >= 0."""
    counts = component_mapping(values, modules, argument, "{component: count per run}")
    bad = {name: value for name, value in counts.items()
           if isinstance(value, bool) or not isinstance(value, int) or value < 0}
    if bad:
        raise PlanError(f"{argument} values must be ints >= 0 (counted per run at the planned call, e.g. by "
                        f"placement.estimate_call(...).flops); got {bad}.")
    return counts


def check_link_bandwidth(link_bandwidth) -> float:
    """Bytes per second: None -> the default (25 GB/s, PCIe 4.0 x16); a positive number; or a size string
    ("25GB", "12.5 GiB") read as that much per second."""
    if link_bandwidth is None:
        return DEFAULT_LINK_BANDWIDTH
    value = _per_second(link_bandwidth)
    if value is None:
        raise PlanError(
            f"link_bandwidth={link_bandwidth!r}: expected host -> accelerator bytes per second, a positive number "
            "(25e9) or a size read per second ('25GB'); None assumes 25 GB/s (PCIe 4.0 x16)."
        )
    return value


def _per_second(value) -> Optional[float]:
    """A positive, finite number of bytes/s, or a size string read per second; None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        speed = float(value)
    else:
        try:
            speed = float(parse_size(value))
        except PlanError:
            return None
    return speed if speed > 0 and speed != float("inf") else None


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


MEASURE_BYTES = 256 * 2**20
CHUNK_BYTES = 8 * 2**20
# Faster than this, a read came from RAM (the page cache), not from a drive (PCIe 5.0 NVMe reads ~14 GB/s).
PAGE_CACHE_SPEED = 20e9
_MEASURED: dict[int, tuple[float, str]] = {}  # st_dev -> (bytes/s, source): once per drive and process


def check_disk_read_bandwidth(value) -> float:
    """Bytes per second: None -> assumed (`DISK_BYTES_PER_S`); a positive number; or a size string ("2GB") read
    per second."""
    if value is None:
        return DISK_BYTES_PER_S
    speed = _per_second(value)
    if speed is None:
        raise PlanError(f"disk_read_bandwidth={value!r}: expected the disk's read bytes per second, a positive "
                        f"number (2e9) or a size read per second ('2GB'); None assumes {DISK_BYTES_PER_S / 1e9:g} "
                        "GB/s (NVMe).")
    return speed


def measure_disk_read(path: str | os.PathLike) -> tuple[float, str]:
    """(bytes/s, source) of reading the file at `path` (a checkpoint shard), measured once per drive."""
    try:
        drive = os.stat(path).st_dev
    except OSError as error:
        raise PlanError(f"Cannot measure the disk read speed on {os.fspath(path)!r}: {error}.") from error
    if drive not in _MEASURED:
        _MEASURED[drive] = _measure(os.fspath(path))
    return _MEASURED[drive]


def _measure(path: str) -> tuple[float, str]:
    with open(path, "rb", buffering=0) as file:
        descriptor = file.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        start, read = time.perf_counter(), 0
        while read < MEASURE_BYTES:
            chunk = file.read(CHUNK_BYTES)
            if not chunk:
                break
            read += len(chunk)
        seconds = time.perf_counter() - start
    if not read:
        raise PlanError(f"Cannot measure the disk read speed on {path!r}: the file is empty.")
    speed = read / max(seconds, 1e-9)
    cached = "; page cache? faster than a drive reads" if speed > PAGE_CACHE_SPEED else ""
    return speed, f"measured: {read / 2**20:.0f} MiB of {os.path.basename(path)}{cached}"
