"""Disk-homed groups read ahead: a group's read and copy run on one background thread (reads queue as one drive
serves them) while the blocks before it compute; a side stream would overlap only the copy. The session issues
one group ahead, so at most two blocks are staged, as `placement.cost` counts them.
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
    global _READER
    with _LOCK:
        if _READER is None:
            _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return _READER.submit(_in_modes(work, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))


def _in_modes(work: Callable[[], T], inference: bool, grad: bool) -> Callable[[], T]:
    """`work` under the caller's autograd modes (thread-local): a tensor copied outside the caller's
    `torch.inference_mode()` cannot become its module's weight inside it (nor the reverse)."""
    def run() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work()
    return run


__all__ = ["THREAD_NAME", "read_ahead"]
