"""Stream a checkpoint into a model built on the meta device, each tensor straight to its device and dtype.

Host memory: `safe_open(...).get_tensor` (safetensors >= 0.6) returns a tensor backed by a private memory
map of the file, so a CPU load that keeps the checkpoint's dtype copies nothing: the weights are the page
cache's pages, mapped copy-on-write, and a CPU load peaks at one model size. A cast or a move to an
accelerator makes the one real copy (cast first, on the host: half the bytes cross the bus for a bf16 load, as
accelerate's `set_module_tensor_to_device` does); the mapped source is dropped right after, and the file is reopened every `_REMAP_BYTES` so the pages already read stop
counting against the process (one 20 GB file would otherwise add its whole size to the peak).
Files are replaced, never rewritten in place, by our saves (`atomic_folder`) and by safetensors' `save_file`,
so a mapped model stays valid when its folder is saved over. Truncating a loaded file in place (not replacing
it) faults the mapped pages with SIGBUS, exactly as for `safetensors.torch.load_file`; load with a `torch_dtype`
cast to get tensors that own their memory.

Load progress in bytes: one bar over a whole pipeline load, labelled with the component being read.

`load_progress(total_bytes, enabled=...)` opens the overall bar (the pipeline loader does, around all its
components); `reading(label)` is what `load_weights` reports to: the overall bar relabelled "Loading
text_encoder_2" when one is open, else a bar of its own for that one model (a model-level load).
Bytes, not tensors: a 2 GB embedding and a 4 KB bias are not the same amount of waiting."""

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
from placement.devices import (
    Accelerators,
    Device,
    detect_accelerators,
    is_accelerator,
    normalize_device,
    torch_device,
)
from placement.errors import PlanError

from ..errors import FolderError, WeightsNotFoundError
from .index import TensorEntry, WeightsIndex, validate_weights


_OVERALL: ContextVar["tqdm | None"] = ContextVar("load_progress", default=None)


def _bar(total: int, label: str, enabled: bool) -> tqdm:
    # disable=None: tqdm shows the bar on terminals and notebooks only (quiet in CI logs and tests).
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
    """The bar that `total_bytes` of `label` advance: the overall one, relabelled, or a new one."""
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
    """One tensor to read, everything about it worked out before the first byte moves: where it is in the
    checkpoint, the device and dtype it is loaded as, and the submodule attribute it goes into."""

    entry: TensorEntry
    device: Device
    target: torch.device
    dtype: torch.dtype
    owner: nn.Module
    attribute: str

    @property
    def loaded_bytes(self) -> int:
        """The bytes the tensor occupies once loaded (after its cast): what the progress bars count."""
        return math.prod(self.entry.shape) * self.dtype.itemsize


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
    accelerators: Accelerators | None = None,
) -> None:
    """Fill `module` (built under `init_empty_weights()`) with the tensors of `weights`, in place.

    `device_map` ({module path: device}, "" for the whole model; None = everything on "cpu"): each tensor goes
    to the device of its longest matching prefix. Parameters mapped to "disk" stay on meta (the dispatch step
    serves them from the checkpoint files); their persistent buffers are loaded to the CPU.
    `dtype`: floating tensors are cast to it, except in submodules named in `keep_in_fp32` (kept float32);
    None keeps each tensor's dtype from the checkpoint. `tied_weights` ({tied name: source name}) are tied
    after loading. `ignore_unexpected`: regexes of checkpoint keys the model may lack (left unread), as
    transformers' `_keys_to_ignore_on_load_unexpected`. Keys and shapes are validated before anything moves
    (then `stream_weights`); on any failure every tensor loaded so far goes back to meta: no half-loaded model
    holds memory. `progress`: a bar in bytes, labelled `label` (default: the class name), or the pipeline's
    overall bar. `accelerators`: the accelerators the device map's indices name (detected when None).
    """
    validate_weights(module, weights, tied_weights=tied_weights, ignore_unexpected=ignore_unexpected)
    stream_weights(module, weights, device_map=device_map, load_dtypes=load_dtypes(weights, dtype, keep_in_fp32),
                   tied_weights=tied_weights, progress=progress, label=label, accelerators=accelerators)


def stream_weights(
    module: nn.Module,
    weights: WeightsIndex,
    *,
    device_map: Mapping[str, Device] | None,
    load_dtypes: Mapping[str, torch.dtype],
    tied_weights: Mapping[str, str] | None = None,
    progress: bool = True,
    label: str | None = None,
    accelerators: Accelerators | None = None,
) -> None:
    """`load_weights` for a caller that validated `weights` against `module` already and worked out each
    tensor's dtype once (`load_dtypes`, {checkpoint name: dtype}): one pass over the files, nothing checked twice.
    Accelerator indices become torch devices through `accelerators` (one detection per load, not per tensor);
    that they exist is the caller's check (the loader makes it once, for the whole plan)."""
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
        set_module_tensor_to_device(module, name, torch_device(normalized[owner], accelerators), value=buffer,
                                    clear_cache=False)


def load_dtypes(weights: WeightsIndex, dtype: torch.dtype | None, keep_in_fp32: Iterable[str] = ()
                ) -> dict[str, torch.dtype]:
    """{checkpoint tensor: the dtype it loads as} (`target_dtype` of each), worked out once per load."""
    keep = tuple(keep_in_fp32 or ())
    return {name: target_dtype(entry, dtype, keep) for name, entry in weights.tensors.items()}


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


def _reads(module: nn.Module, weights: WeightsIndex, device_map: Mapping[str, Device] | None,
           load_dtypes: Mapping[str, torch.dtype], accelerators: Accelerators) -> list[_Read]:
    """Every tensor of `weights` the module takes (checkpoint keys it lacks are left unread), with its device:
    the longest `device_map` key that contains it (None: everything on the CPU); parameters on "disk" stay on
    meta (the dispatch step serves them). Torch devices are looked up once per distinct device."""
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
    # Reopening only helps when the mapped source of each tensor is dropped (cast or moved off the CPU); tensors
    # that keep their dtype on the CPU are the mapping itself, so the file is opened once.
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
    """Put `value` (cast, then moved) into the module in place of its meta tensor, as a parameter of the class it
    had or as a buffer. What `accelerate.utils.set_module_tensor_to_device` does for a plain tensor, without the
    per-call lookups and checks that cost it a third of a load's time (every fact is in `read` already); other
    parameter classes (quantized ones) go through accelerate."""
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
