"""Where an offloaded group's weights live between calls: host memory, or a safetensors file on disk.

Both stores put the "offloaded form" of each tensor back into the module when the group is released, so
the module always holds something valid between calls: a real host tensor (`HostStore`), or a `meta`
placeholder of the right shape and dtype (`DiskStore`: the bytes are only in the file then).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import safetensors.torch
import torch
from safetensors import safe_open

from placement.devices import safetensors_device

from ..memory_errors import OffloadConfigError
from ..tensor_slots import ModelTensor


class HostStore:
    """Weights kept on `offload_device` (normally the CPU); pinned when a side stream copies them."""

    def __init__(self, *, offload_device: torch.device, pin_memory: bool) -> None:
        self.offload_device = offload_device
        self.pin_memory = pin_memory
        self._tensors: dict[str, torch.Tensor] = {}

    def take(self, entries: Sequence[ModelTensor]) -> None:
        """Move each tensor to the store; the module then holds the stored copy (no second copy in RAM)."""
        for entry in entries:
            stored = entry.get().detach().to(self.offload_device)
            if self.pin_memory and stored.device.type == "cpu":
                stored = stored.pin_memory()
            self._tensors[entry.key] = stored
            entry.set(stored)

    def read(self, *, pinned: bool, device: torch.device | None = None) -> Mapping[str, torch.Tensor]:
        """The stored tensors themselves (already pinned when the store pins)."""
        return self._tensors

    def release(self, entries: Sequence[ModelTensor]) -> None:
        for entry in entries:
            entry.set(self._tensors[entry.key])

    def restore(self, entries: Sequence[ModelTensor], devices: Mapping[str, torch.device]) -> None:
        for entry in entries:
            stored = self._tensors.pop(entry.key)
            # A pinned copy is page-locked RAM the OS cannot reclaim; give the module an ordinary one.
            restored = stored.to(devices[entry.key], copy=stored.is_pinned())
            entry.set(restored)


class DiskStore:
    """Weights in one safetensors file per group; the module holds `meta` placeholders between calls."""

    def __init__(self, *, path: str) -> None:
        self.path = path
        # Placeholders keep the stored shape and dtype even if the module held another form when released
        # (e.g. a layerwise-casting upcast copy): between calls the module shows what the file holds.
        self._placeholders: dict[str, torch.Tensor] = {}

    def take(self, entries: Sequence[ModelTensor]) -> None:
        # Own contiguous CPU copies: safetensors refuses tensors that share storage (views, tied slices).
        tensors = {entry.key: entry.get().detach().to("cpu").contiguous().clone() for entry in entries}
        partial = self.path + ".partial"
        try:
            safetensors.torch.save_file(tensors, partial, metadata={"format": "pt"})
            os.replace(partial, self.path)
        except OSError as error:
            _remove_quietly(partial)
            raise OffloadConfigError(
                f"Could not write offloaded weights to {self.path!r} ({error}). Check that the "
                "offload_to_disk_path folder is writable and has room, or offload to host memory instead."
            ) from error
        self._placeholders = {key: torch.empty_like(tensor, device="meta") for key, tensor in tensors.items()}
        del tensors
        self.release(entries)

    def read(self, *, pinned: bool, device: torch.device | None = None) -> Mapping[str, torch.Tensor]:
        target = "cpu" if pinned or device is None else safetensors_device(device)
        with safe_open(self.path, framework="pt", device=target) as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}
        if pinned:
            tensors = {key: tensor.pin_memory() for key, tensor in tensors.items()}
        return tensors

    def release(self, entries: Sequence[ModelTensor]) -> None:
        for entry in entries:
            entry.set(self._placeholders[entry.key])

    def restore(self, entries: Sequence[ModelTensor], devices: Mapping[str, torch.device]) -> None:
        tensors = self.read(pinned=False)
        for entry in entries:
            entry.set(tensors[entry.key].to(devices[entry.key]))
        _remove_quietly(self.path)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
