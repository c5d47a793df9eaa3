"""Reading disk-homed groups ahead: the read of the next group runs on a background thread while the current one
computes.

A group homed on disk (`DiskStore`, `CheckpointStore`) spends most of its onload reading files; a side CUDA
stream overlaps only the host -> device copy, and without one (a blocking transfer, virtual accelerators) the
read would sit between two blocks' compute. So a group that reads ahead (`ModuleGroup.reads_ahead`, set by the
session that prefetches it) hands its whole onload -- read into (pinned, where the transfer pins) staging, then
the copy -- to this reader and returns at once; its hook waits for the result just before the group computes.
One thread for the process: reads queue in the order they were issued (one drive serves them), and a block's
read starts while the blocks before it compute, since torch releases the GIL in its kernels and the reads in
their file I/O. The session issues one group ahead (the next block), so at most two blocks' weights are staged
at once, as the plan's stream buffer and host staging count them (`placement.cost`, `placement.host_memory`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

THREAD_NAME = "placement-read-ahead"
_LOCK = threading.Lock()
_READER: ThreadPoolExecutor | None = None


def read_ahead(work: Callable[[], T]) -> Future[T]:
    """Run `work` (a group's read and copy) on the reader thread; its result is waited for when needed."""
    global _READER
    with _LOCK:
        if _READER is None:
            _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return _READER.submit(_in_modes(work, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))


def _in_modes(work: Callable[[], T], inference: bool, grad: bool) -> Callable[[], T]:
    """`work` under the caller's autograd modes: they are thread-local, and a tensor copied outside the caller's
    `torch.inference_mode()` cannot become its module's weight inside it (nor the reverse)."""
    def run() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work()
    return run


__all__ = ["THREAD_NAME", "read_ahead"]
