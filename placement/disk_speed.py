"""How fast disk-homed weights are read: stated by the caller, or measured once on the checkpoint's drive.

Disk-homed blocks are read ahead on a background thread while earlier blocks compute (the runtime's
`hooks.group_offload.read_ahead`), so a call with a disk-homed component takes about the larger of its read time
and its compute time, not their sum; the time model needs the read speed for the first of the two
(`Plan.disk_read_bandwidth`). Unless stated, it is assumed (`time_model.DISK_BYTES_PER_S`, NVMe): a drive's read
speed spans two orders of magnitude (network storage to NVMe RAID), so a plan that matters states or measures it.

`measure_disk_read(path)` reads up to `MEASURE_BYTES` of the file at `path` once per drive and process, after
asking the kernel to drop the file's cached pages (a read served from the page cache measures RAM, not the
drive; where the kernel keeps them anyway the figure is an upper bound, and its source says "page cache?" when
it is faster than any drive reads).
"""

from __future__ import annotations

import os
import time
from typing import Optional

from .errors import PlanError
from .sizes import parse_size
from .time_model import DISK_BYTES_PER_S

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
    speed: Optional[float] = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        speed = float(value)
    elif isinstance(value, str):
        try:
            speed = float(parse_size(value))
        except PlanError:
            speed = None
    if speed is None or not speed > 0 or speed == float("inf"):
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


__all__ = ["check_disk_read_bandwidth", "measure_disk_read"]
