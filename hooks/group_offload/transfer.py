"""How a group's tensors reach the onload device: a blocking copy, or a side CUDA stream from pinned memory that
the compute stream waits on by event (the CPU does not block).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class PendingCopy:
    """Tensors whose copy was queued; `ready` is None when the copy already finished (blocking)."""

    tensors: Mapping[str, torch.Tensor]
    ready: torch.cuda.Event | None = None


class BlockingTransfer:
    uses_pinned_memory = False
    prefetches = False

    def copy(self, sources: Mapping[str, torch.Tensor], device: torch.device) -> PendingCopy:
        return PendingCopy(tensors={key: tensor.to(device) for key, tensor in sources.items()})

    def wait(self, pending: PendingCopy) -> None:
        """The copy finished inside `copy`."""


class StreamTransfer:
    uses_pinned_memory = True
    prefetches = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, sources: Mapping[str, torch.Tensor], device: torch.device) -> PendingCopy:
        with torch.cuda.stream(self.stream):
            tensors = {key: tensor.to(device, non_blocking=True) for key, tensor in sources.items()}
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return PendingCopy(tensors=tensors, ready=ready)

    def wait(self, pending: PendingCopy) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(pending.ready)
        for tensor in pending.tensors.values():
            # Allocated on the side stream, used on the compute stream: free only after compute is done.
            tensor.record_stream(compute)
