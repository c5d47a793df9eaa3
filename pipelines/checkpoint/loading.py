"""Stream a checkpoint into a model built on the meta device, each tensor straight to its device and dtype.

Host memory: `safe_open(...).get_tensor` (safetensors >= 0.6) returns a tensor backed by a private memory
map of the file, so a CPU load that keeps the checkpoint's dtype copies nothing: the weights are the page
cache's pages, mapped copy-on-write, and a CPU load peaks at one model size. A cast or a move to an
accelerator makes the one real copy, handed to `accelerate.utils.set_module_tensor_to_device`; the mapped
source is dropped right after, and the file is reopened every `_REMAP_BYTES` so the pages already read stop
counting against the process (one 20 GB file would otherwise add its whole size to the peak).
Files are replaced, never rewritten in place, by our saves (`atomic_folder`) and by safetensors' `save_file`,
so a mapped model stays valid when its folder is saved over. Truncating a loaded file in place (not replacing
it) faults the mapped pages with SIGBUS, exactly as for `safetensors.torch.load_file`; load with a `torch_dtype`
cast to get tensors that own their memory.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors import SafetensorError, safe_open
from torch import nn

from placement.device_maps import owning_key, tensor_devices
from placement.devices import Device, accelerators_present, is_accelerator, normalize_device, torch_device
from placement.errors import InvalidDeviceError

from .errors import CheckpointReadError, CorruptCheckpointError
from .index import TensorEntry, WeightsIndex
from .progress import reading
from .validation import validate_weights

_REMAP_BYTES = 256 * 1024**2


@dataclass(frozen=True, kw_only=True)
class _Read:
    """One tensor to read: where it is in the checkpoint, the device and dtype it is loaded as."""

    entry: TensorEntry
    device: Device
    dtype: torch.dtype


def load_weights(
    module: nn.Module,
    weights: WeightsIndex,
    *,
    device_map: Mapping[str, Device] | None = None,
    dtype: torch.dtype | None = None,
    keep_in_fp32: Iterable[str] = (),
    tied_weights: Mapping[str, str] | None = None,
    ignore_unexpected: Iterable[str] = (),
    progress: bool = True,
    label: str | None = None,
) -> None:
    """Fill `module` (built under `init_empty_weights()`) with the tensors of `weights`, in place.

    `device_map` ({module path: device}, "" for the whole model; None = everything on "cpu"): each tensor goes
    to the device of its longest matching prefix. Parameters mapped to "disk" stay on meta (the dispatch step
    serves them from the checkpoint files); their persistent buffers are loaded to the CPU.
    `dtype`: floating tensors are cast to it, except in submodules named in `keep_in_fp32` (kept float32);
    None keeps each tensor's dtype from the checkpoint. `tied_weights` ({tied name: source name}) are tied
    after loading. `ignore_unexpected`: regexes of checkpoint keys the model may lack (left unread), as
    transformers' `_keys_to_ignore_on_load_unexpected`. Validation (keys, shapes, devices) runs before anything
    moves; on any failure every tensor loaded so far goes back to meta: no half-loaded model holds memory.
    `progress`: a bar in bytes, labelled `label` (default: the class name), or the pipeline's overall bar.
    """
    validate_weights(module, weights, tied_weights=tied_weights, ignore_unexpected=ignore_unexpected)
    devices = tensor_devices(module, device_map)
    check_accelerators_exist(type(module).__name__, set(devices.values()))
    buffer_names = {name for name, _ in module.named_buffers()}
    keep = tuple(keep_in_fp32 or ())
    plan = [
        _Read(
            entry=entry,
            device=_host_if_disk(devices[name], name in buffer_names),
            dtype=target_dtype(entry, dtype, keep),
        )
        for name, entry in weights.tensors.items()
        if name in devices and (devices[name] != "disk" or name in buffer_names)
    ]
    try:
        _stream(module, plan, progress=progress, label=label or type(module).__name__)
        tie_weights(module, tied_weights)
        _place_unsaved_buffers(module, device_map)
    except BaseException:
        module.to("meta")
        raise


def check_accelerators_exist(what: str, devices) -> None:
    """Loading onto accelerators this machine lacks is refused (planning for them is fine)."""
    count = accelerators_present()
    absent = sorted(d for d in set(devices) if is_accelerator(d) and d >= count)
    if absent:
        raise InvalidDeviceError(
            f"The device map puts weights of {what} on accelerator(s) {absent}, but this machine "
            f"has {count} accelerator(s). Load with device_map='cpu', or plan for the accelerators present."
        )


def target_dtype(entry: TensorEntry, dtype: torch.dtype | None, keep_in_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype `entry` is loaded as: integer/bool tensors never change; with a `dtype`, tensors of the modules
    in `keep_in_fp32` (`placement.sizing.kept_fp32_module_names`, the rule sizing uses) become float32."""
    if dtype is None or not entry.dtype.is_floating_point:
        return entry.dtype  # no torch_dtype: every tensor as saved, fp32-kept modules included (as diffusers)
    if keep_in_fp32 and any(part in keep_in_fp32 for part in entry.name.split(".")):
        return torch.float32
    return dtype


def tie_weights(module: nn.Module, tied_weights: Mapping[str, str] | None) -> None:
    """Make each tied parameter the same object as its source (after `init_empty_weights`, which unties)."""
    for tied, source in (tied_weights or {}).items():
        owner_path, _, attribute = tied.rpartition(".")
        owner = module.get_submodule(owner_path)
        source_value = module.get_parameter(source)
        setattr(owner, attribute, source_value)


def _place_unsaved_buffers(module: nn.Module, device_map: Mapping[str, Device] | None) -> None:
    """Buffers no checkpoint holds (non-persistent ones: CLIP's `position_ids`, rotary `inv_freq`) were made on
    the CPU by the model's constructor: each goes to the accelerator its module is planned on, as the saved
    tensors did (on a GPU, a CPU `position_ids` indexing a GPU embedding fails). Streamed modules' hooks move
    their own buffers."""
    if device_map is None:
        return
    normalized = {key: normalize_device(device) for key, device in device_map.items()}
    saved = set(module.state_dict(keep_vars=True))
    for name, buffer in list(module.named_buffers()):
        owner = owning_key(name, normalized)
        if name in saved or owner is None or buffer.device.type == "meta" or not is_accelerator(normalized[owner]):
            continue
        set_module_tensor_to_device(module, name, torch_device(normalized[owner]), value=buffer, clear_cache=False)


def _host_if_disk(device: Device, is_buffer: bool) -> Device:
    # Buffers of disk-offloaded modules are loaded: accelerate's hooks do not offload them by default.
    return "cpu" if device == "disk" and is_buffer else device


def _stream(module: nn.Module, plan: list[_Read], *, progress: bool, label: str) -> None:
    by_file: dict[Path, list[_Read]] = defaultdict(list)
    for read in plan:
        by_file[read.entry.file].append(read)
    with reading(label, sum(loaded_bytes(read) for read in plan), enabled=progress) as bar:
        for path, items in by_file.items():
            _stream_file(module, path, items, on_tensor=bar.update)


def loaded_bytes(read: _Read) -> int:
    """The bytes a tensor occupies once loaded (after its cast): what the progress bars count."""
    return torch.Size(read.entry.shape).numel() * read.dtype.itemsize


def _stream_file(module: nn.Module, path: Path, items: list[_Read], *, on_tensor: Callable[[int], object]) -> None:
    pending = deque(items)
    try:
        while pending:
            mapped = 0
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                while pending and mapped < _REMAP_BYTES:
                    item = pending.popleft()
                    entry = item.entry
                    value = handle.get_tensor(entry.name)
                    # clear_cache=False: accelerate would empty the CUDA cache after every single tensor.
                    set_module_tensor_to_device(
                        module, entry.name, torch_device(item.device), value=value, dtype=item.dtype, clear_cache=False
                    )
                    mapped += entry.nbytes
                    on_tensor(loaded_bytes(item))
    except SafetensorError as error:
        raise CorruptCheckpointError(f"Reading {str(path)!r} failed ({error}); the file is corrupt.") from error
    except OSError as error:  # an I/O error, a file removed or unreadable mid-load
        raise CheckpointReadError(
            f"Reading {str(path)!r} failed: {error.strerror or error}. Nothing was kept loaded; check the disk and "
            "the file's permissions, then load again."
        ) from error

