"""Where an offloaded group's weights rest between calls: host memory (`HostStore`), one safetensors file per
group (`DiskStore`), or the checkpoint's own files (`CheckpointStore`). Released, the module holds the resting form:
a host tensor or a `meta` placeholder. `take` / `forget` / `holds` follow edits (`module_group.regroup`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import safetensors.torch
import torch
from safetensors import safe_open

from placement.devices import safetensors_device

from ..errors import OffloadConfigError
from ..pinned_files import PinnedWeightsLoader
from ..tensor_slots import ModelTensor


class HostStore:
    """Weights kept on `offload_device` (normally the CPU); pinned when a side stream copies them."""

    home = "cpu"

    def __init__(self, *, offload_device: torch.device, pin_memory: bool) -> None:
        self.offload_device = offload_device
        self.pin_memory = pin_memory
        self._tensors: dict[str, torch.Tensor] = {}

    def home_of(self, key: str) -> str:
        return "cpu"

    def take(self, entries: Sequence[ModelTensor]) -> None:
        """Move each tensor to the store; the module then holds the stored copy (no second copy in RAM)."""
        for entry in entries:
            stored = entry.get().detach().to(self.offload_device)
            if self.pin_memory and stored.device.type == "cpu":
                stored = stored.pin_memory()
            self._tensors[entry.key] = stored
            entry.set(stored)

    def read(self, *, pinned: bool, device: torch.device | None = None) -> Mapping[str, torch.Tensor]:
        return self._tensors  # already pinned when the store pins

    def release(self, entries: Sequence[ModelTensor]) -> None:
        for entry in entries:
            entry.set(self._tensors[entry.key])

    def holds(self, entry: ModelTensor) -> bool:
        stored, held = self._tensors.get(entry.key), entry.get()
        return stored is not None and _same_data(held, stored)

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._tensors.pop(key, None)

    def restore(self, entries: Sequence[ModelTensor], devices: Mapping[str, torch.device]) -> None:
        for entry in entries:
            stored = self._tensors.pop(entry.key)
            # A pinned copy is page-locked RAM the OS cannot reclaim; give the module an ordinary one.
            restored = stored.to(devices[entry.key], copy=stored.is_pinned())
            entry.set(restored)


class DiskStore:
    """Weights in one safetensors file per group; the module holds `meta` placeholders between calls."""

    home = "disk"

    def __init__(self, *, path: str) -> None:
        self.path = path
        # Placeholders keep the stored shape and dtype even if the module held another form when released
        # (e.g. a layerwise-casting upcast copy): between calls the module shows what the file holds.
        self._placeholders: dict[str, torch.Tensor] = {}

    def home_of(self, key: str) -> str:
        return "disk"

    def take(self, entries: Sequence[ModelTensor]) -> None:
        # Own contiguous CPU copies: safetensors refuses tensors that share storage (views, tied slices). Taken
        # again (entries added or replaced later), the file is rewritten with what it held besides them.
        tensors = dict(self.read(pinned=False)) if os.path.exists(self.path) else {}
        tensors.update({entry.key: entry.get().detach().to("cpu").contiguous().clone() for entry in entries})
        self._write(tensors)
        self._placeholders.update({entry.key: torch.empty_like(tensors[entry.key], device="meta") for entry in entries})
        del tensors
        self.release(entries)

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
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

    def holds(self, entry: ModelTensor) -> bool:
        placeholder = self._placeholders.get(entry.key)
        return placeholder is not None and _same_placeholder(entry.get(), placeholder)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop `keys`, rewriting the file without them (a read would otherwise still move their bytes)."""
        keys = [key for key in keys if key in self._placeholders]
        if not keys:
            return
        tensors = {key: tensor for key, tensor in self.read(pinned=False).items() if key not in keys}
        self._write(tensors)
        for key in keys:
            del self._placeholders[key]

    def restore(self, entries: Sequence[ModelTensor], devices: Mapping[str, torch.device]) -> None:
        tensors = self.read(pinned=False)
        for entry in entries:
            entry.set(tensors[entry.key].to(devices[entry.key]))
        _remove_quietly(self.path)


class CheckpointStore:
    """A placed component's "disk" parameters (on `meta`) read from the checkpoint's files through its offload
    index at each onload; everything else (buffers, host-homed parameters, adapters) in a `HostStore`."""

    home = "disk"

    def __init__(self, *, disk_weights: Mapping[str, Mapping[str, str]], pin_memory: bool) -> None:
        self._loader = PinnedWeightsLoader(index={key: dict(info) for key, info in disk_weights.items()})
        self._host = HostStore(offload_device=torch.device("cpu"), pin_memory=pin_memory)
        self._on_disk: dict[str, torch.Tensor] = {}  # key -> its meta placeholder
        self.pin_memory = pin_memory

    def home_of(self, key: str) -> str:
        return "disk" if key in self._on_disk else "cpu"

    def take(self, entries: Sequence[ModelTensor]) -> None:
        on_disk = [entry for entry in entries if entry.get().is_meta]
        unserved = [entry.key for entry in on_disk if entry.key not in self._loader.index]
        if unserved:
            raise OffloadConfigError(
                f"{len(unserved)} tensor(s) have no data (meta) and no checkpoint file serves them, e.g. "
                f"{unserved[:3]}. Pass the checkpoint's offload index (WeightsIndex.offload_index) as disk_weights."
            )
        self._on_disk.update({entry.key: entry.get() for entry in on_disk})
        self._host.take([entry for entry in entries if entry.key not in self._on_disk])

    def read(self, *, pinned: bool, device: torch.device | None = None) -> Mapping[str, torch.Tensor]:
        tensors = dict(self._host.read(pinned=pinned))
        for key in self._on_disk:
            tensor = self._loader[key]
            tensors[key] = tensor.pin_memory() if pinned and self.pin_memory else tensor
        return tensors

    def release(self, entries: Sequence[ModelTensor]) -> None:
        for entry in entries:
            placeholder = self._on_disk.get(entry.key)
            if placeholder is None:
                self._host.release([entry])
            else:
                entry.set(placeholder)

    def holds(self, entry: ModelTensor) -> bool:
        if entry.key in self._on_disk:
            return _same_placeholder(entry.get(), self._on_disk[entry.key])
        return self._host.holds(entry)

    def forget(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._on_disk.pop(key, None)
        self._host.forget(keys)

    def restore(self, entries: Sequence[ModelTensor], devices: Mapping[str, torch.device]) -> None:
        """Disk weights come back as CPU tensors (as `hooks.dispatch.undispatch` does), so `.to()` works."""
        for entry in entries:
            if entry.key in self._on_disk:
                entry.set(self._loader[entry.key].to("cpu"))
            else:
                self._host.restore([entry], devices)
        self._on_disk = {}


def _same_data(held: torch.Tensor, stored: torch.Tensor) -> bool:
    return (held.device == stored.device and held.dtype == stored.dtype and held.shape == stored.shape
            and held.data_ptr() == stored.data_ptr())


def _same_placeholder(held: torch.Tensor, placeholder: torch.Tensor) -> bool:
    """`held` is a meta placeholder like `placeholder` (releasing wraps it anew, so identity is not kept)."""
    return held.is_meta and held.dtype == placeholder.dtype and held.shape == placeholder.shape


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
