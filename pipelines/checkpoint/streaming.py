"""Stream a checkpoint into a model built on meta, each tensor straight to its device and dtype, with a progress
bar in bytes (one over a whole pipeline load when the loader opens `load_progress`).

A CPU load keeping the checkpoint's dtype copies nothing: `safe_open(...).get_tensor` returns tensors backed by
a private map of the file. A cast or a move makes the one real copy (cast first, on the host, as accelerate
does), and the file is reopened every `_REMAP_BYTES` so pages already read stop counting against the process.
Saves replace files rather than rewrite them, so a mapped model stays valid when its folder is saved over."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from placement.device_maps import owning_key
from placement.devices import Accelerators, Device, detect_accelerators, is_accelerator, normalize_device, torch_device
from placement.errors import PlanError

from ..errors import FolderError, WeightsNotFoundError
from .index import TensorEntry, WeightsIndex, validate_weights


_OVERALL: ContextVar["tqdm | None"] = ContextVar("load_progress", default=None)


def _bar(total: int, label: str, enabled: bool) -> tqdm:
    # disable=None: shown on terminals and notebooks only.
    return tqdm(total=total, desc=f"Loading {label}", unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True)


@contextmanager
def load_progress(total_bytes: int, *, enabled: bool, label: str = "pipeline") -> Iterator[tqdm]:
    """One bar for everything `load_weights` reads inside the block."""
    bar = _bar(total_bytes, label, enabled)
    token = _OVERALL.set(bar)
    try:
        with bar:
            yield bar
    finally:
        _OVERALL.reset(token)


@contextmanager
def reading(label: str, total_bytes: int, *, enabled: bool) -> Iterator[tqdm]:
    """The overall bar, relabelled, or a new one for a model-level load."""
    overall = _OVERALL.get()
    if overall is not None:
        overall.set_description(f"Loading {label}")
        yield overall
        return
    with _bar(total_bytes, label, enabled) as bar:
        yield bar


_REMAP_BYTES = 256 * 1024**2


@dataclass(frozen=True, kw_only=True)
class _Read:
    """One tensor to read, with everything about it worked out before the first byte moves."""

    entry: TensorEntry
    device: Device
    target: torch.device
    dtype: torch.dtype
    owner: nn.Module
    attribute: str

    @property
    def loaded_bytes(self) -> int:
        return math.prod(self.entry.shape) * self.dtype.itemsize


def load_weights(module: nn.Module, weights: WeightsIndex, *, device_map: Mapping[str, Device] | None = None,
                 dtype: torch.dtype | None = None, keep_in_fp32: Iterable[str] = (),
                 tied_weights: Mapping[str, str] | None = None, ignore_unexpected: Iterable[str] = (),
                 progress: bool = True, label: str | None = None, accelerators: Accelerators | None = None) -> None:
    """Fill `module` (built on meta) with the tensors of `weights`, in place.

    `device_map` ({module path: device}, None = all on "cpu"): the longest matching prefix wins; "disk" parameters
    stay on meta for the dispatch step. Keys and shapes are validated first; on any failure every tensor goes back
    to meta, so no half-loaded model holds memory."""
    validate_weights(module, weights, tied_weights=tied_weights, ignore_unexpected=ignore_unexpected)
    stream_weights(module, weights, device_map=device_map, load_dtypes=load_dtypes(weights, dtype, keep_in_fp32),
                   tied_weights=tied_weights, progress=progress, label=label, accelerators=accelerators)


def stream_weights(module: nn.Module, weights: WeightsIndex, *, device_map: Mapping[str, Device] | None,
                   load_dtypes: Mapping[str, torch.dtype], tied_weights: Mapping[str, str] | None = None,
                   progress: bool = True, label: str | None = None,
                   accelerators: Accelerators | None = None) -> None:
    """`load_weights` for a caller that validated already and worked out each tensor's dtype (`load_dtypes`)."""
    accelerators = accelerators or detect_accelerators()
    plan = _reads(module, weights, device_map, load_dtypes, accelerators)
    try:
        _stream(plan, progress=progress, label=label or type(module).__name__)
        tie_weights(module, tied_weights)
        _place_unsaved_buffers(module, device_map, accelerators)
    except BaseException:
        module.to("meta")
        raise


def _place_unsaved_buffers(module: nn.Module, device_map: Mapping[str, Device] | None,
                           accelerators: Accelerators) -> None:
    """Buffers no checkpoint holds (CLIP's `position_ids`) to the accelerator their module is planned on: a CPU
    `position_ids` indexing a GPU embedding fails. Streamed modules' hooks move their own."""
    if device_map is None:
        return
    normalized = {key: normalize_device(device) for key, device in device_map.items()}
    saved = set(module.state_dict(keep_vars=True))
    for name, buffer in list(module.named_buffers()):
        owner = owning_key(name, normalized)
        if name in saved or owner is None or buffer.device.type == "meta" or not is_accelerator(normalized[owner]):
            continue
        set_module_tensor_to_device(module, name, torch_device(normalized[owner], accelerators), value=buffer,
                                    clear_cache=False)


def load_dtypes(weights: WeightsIndex, dtype: torch.dtype | None, keep_in_fp32: Iterable[str] = ()
                ) -> dict[str, torch.dtype]:
    keep = tuple(keep_in_fp32 or ())
    return {name: target_dtype(entry, dtype, keep) for name, entry in weights.tensors.items()}


def target_dtype(entry: TensorEntry, dtype: torch.dtype | None, keep_in_fp32: tuple[str, ...]) -> torch.dtype:
    """Integer/bool tensors never change; with a `dtype`, `keep_in_fp32` modules' tensors become float32."""
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


def _reads(module: nn.Module, weights: WeightsIndex, device_map: Mapping[str, Device] | None,
           load_dtypes: Mapping[str, torch.dtype], accelerators: Accelerators) -> list[_Read]:
    """Every tensor of `weights` the module takes, with its device; "disk" parameters are left to the dispatch step."""
    mapped = {"": "cpu"} if device_map is None else {key: normalize_device(d) for key, d in device_map.items()}
    whole = list(mapped) == [""]  # one device for everything: no prefix to look up per tensor
    submodules = dict(module.named_modules(remove_duplicate=False))
    targets: dict[Device, torch.device] = {}
    reads, unmapped = [], []
    for name, entry in weights.tensors.items():
        owner_path, _, attribute = name.rpartition(".")
        owner = submodules.get(owner_path)
        is_buffer = owner is not None and attribute in owner._buffers
        if owner is None or not (is_buffer or attribute in owner._parameters):
            continue
        key = "" if whole else owning_key(name, mapped)
        if key is None:
            unmapped.append(name)
            continue
        if mapped[key] == "disk" and not is_buffer:
            continue
        # Buffers of disk-offloaded modules are loaded: accelerate's hooks do not offload them by default.
        device = "cpu" if mapped[key] == "disk" else mapped[key]
        if device not in targets:
            targets[device] = torch_device(device, accelerators)
        reads.append(_Read(entry=entry, device=device, target=targets[device], dtype=load_dtypes[name],
                           owner=owner, attribute=attribute))
    if unmapped:
        raise PlanError(
            f"The device_map does not place {len(unmapped)} tensor(s) of {type(module).__name__}, e.g. "
            f"{unmapped[0]!r}. Map every submodule (or '' for the whole model) to a device."
        )
    return reads


def _stream(plan: list[_Read], *, progress: bool, label: str) -> None:
    by_file: dict[Path, list[_Read]] = defaultdict(list)
    for read in plan:
        by_file[read.entry.file].append(read)
    with reading(label, sum(read.loaded_bytes for read in plan), enabled=progress) as bar:
        for path, items in by_file.items():
            _stream_file(path, items, on_tensor=bar.update)


def _stream_file(path: Path, items: list[_Read], *, on_tensor: Callable[[int], object]) -> None:
    pending = deque(items)
    # Tensors kept as they are on the CPU are the mapping itself: reopening would free nothing.
    copies = any(item.dtype != item.entry.dtype or item.target.type != "cpu" for item in items)
    remap_bytes = _REMAP_BYTES if copies else math.inf
    try:
        while pending:
            mapped = 0
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                while pending and mapped < remap_bytes:
                    item = pending.popleft()
                    set_tensor(item, handle.get_tensor(item.entry.name))
                    mapped += item.entry.nbytes
                    on_tensor(item.loaded_bytes)
    except SafetensorError as error:
        raise FolderError(f"Reading {str(path)!r} failed ({error}); the file is corrupt.") from error
    except OSError as error:  # an I/O error, a file removed or unreadable mid-load
        raise WeightsNotFoundError(
            f"Reading {str(path)!r} failed: {error.strerror or error}. Nothing was kept loaded; check the disk and "
            "the file's permissions, then load again."
        ) from error


def set_tensor(read: _Read, value: torch.Tensor) -> None:
    """`value` cast, moved and set in place of its meta tensor: accelerate's `set_module_tensor_to_device` without
    the per-call lookups that cost a third of a load's time; other parameter classes (quantized) go through it."""
    if value.dtype != read.dtype:
        value = value.to(read.dtype)
    value = value.to(read.target)  # the same tensor when it is there already (a CPU load keeps the mapping)
    parameters = read.owner._parameters
    if read.attribute not in parameters:
        read.owner._buffers[read.attribute] = value
    elif type(old := parameters[read.attribute]) is nn.Parameter:
        parameters[read.attribute] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:  # clear_cache=False: accelerate would empty the CUDA cache after every single tensor
        set_module_tensor_to_device(read.owner, read.attribute, read.target, value=value, dtype=read.dtype,
                                    clear_cache=False)
