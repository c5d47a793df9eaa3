"""The OWNER reader: a component loaded by the library that owns its format, then placed by our runtime.

    owner map = the plan's device map as the owner can take it      (owner_device_map)
    module    = cls.from_pretrained(folder, device_map=owner map, dtype=the planned dtype, quantization...)
                 or cls.from_single_file(file, config=local folder, ...)
    undispatch(module)                 # the owner's own hooks off (offloaded weights come back to the CPU)
    each planned entry moved to its device; "disk" entries written to the offload folder (safetensors)
    -> the module and its disk offload index, for `placing.attach_runtime` to put our runtime on

The owner loads straight onto a real accelerator when the plan puts weights there. Entries it cannot take
(virtual accelerators, which exist for this library only; "disk", which our runtime serves from safetensors
files of its own) are loaded to the CPU and moved after. A quantized format's tensors are moved as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import safetensors.torch
import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from hooks.dispatch import DiskWeights, undispatch
from placement.device_maps import flatten_device_map, owning_key
from placement.devices import Accelerators, Device, is_accelerator, torch_device

from ..errors import PipelineLoadError
from ..hf.owner_loading import OwnerLoad, load_with_owner, remove_owner_state
from .meta_records import MetaComponent


def read_with_owner(meta: MetaComponent, device_map: Mapping[str, Device] | None, *, accelerators: Accelerators,
                    offload_folder: str | Path | None) -> tuple[nn.Module, DiskWeights | None]:
    """`meta`'s component loaded by its owner and moved to `device_map` (None: the CPU, no runtime)."""
    owner: OwnerLoad = meta.owner
    flat = flatten_device_map(meta.module, device_map or {"": "cpu"})
    module = load_with_owner(owner, owner_device_map(flat, accelerators, multi=owner.takes_multi_device_maps),
                             name=meta.name)
    try:
        undispatch(module)
        remove_owner_state(module)
        move_entries(module, flat, accelerators)
        disk = write_disk_entries(module, flat, meta.name, offload_folder)
    except BaseException:
        undispatch(module)
        module.to("meta")
        raise
    return module, disk


def owner_device_map(flat: Mapping[str, Device], accelerators: Accelerators, *, multi: bool) -> dict:
    """The plan's map in the owner's terms: a real accelerator as its torch device, everything else the CPU
    (virtual accelerators and "disk" are ours to fill); one entry when all go to one place or the owner takes
    one only. The CPU is given as `torch.device("cpu")`, never the string "cpu": to the owners' quantizers
    "cpu" means offloaded, which they leave unquantized (diffusers' torchao) or refuse (bitsandbytes); here it
    only says where to read the weights to (the offloading is ours)."""
    translated = {path: _owner_device(device, accelerators) for path, device in flat.items()}
    places = set(translated.values())
    if len(places) == 1:
        return {"": places.pop()}
    if not multi:
        return {"": _HOST}
    return translated


_HOST = torch.device("cpu")


def _owner_device(device: Device, accelerators: Accelerators) -> torch.device:
    if is_accelerator(device) and not accelerators.virtual:
        return torch_device(device, accelerators)
    return _HOST


def move_entries(module: nn.Module, flat: Mapping[str, Device], accelerators: Accelerators) -> None:
    """Every accelerator entry of the plan moved to its device, tensors as they are (quantized ones keep their
    format: `.to()` of a torchao/quanto/bitsandbytes tensor moves its inner data and scales)."""
    for path, device in flat.items():
        if not is_accelerator(device):
            continue
        target = torch_device(device, accelerators)
        owner = _owner_of(module, path)
        if isinstance(owner, nn.Module):
            owner.to(target)
        else:
            set_module_tensor_to_device(module, path, target)


def _owner_of(module: nn.Module, path: str):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None  # a direct tensor key (a top-level parameter or buffer)


def write_disk_entries(module: nn.Module, flat: Mapping[str, Device], name: str,
                       offload_folder: str | Path | None) -> DiskWeights | None:
    """The parameters of the "disk" entries written to `offload_folder/<name>/` as safetensors and left on meta;
    their offload index (what our disk runtime reads back per forward). Buffers stay in RAM, as for every
    disk-offloaded component."""
    disk_keys = [path for path, device in flat.items() if device == "disk"]
    if not disk_keys:
        return None
    if offload_folder is None:
        raise PipelineLoadError(
            f"Component {name!r} is planned partly on 'disk', but no offload_folder was given to write its weights "
            "to (its format is read by its owner, not served from its own checkpoint files). Pass offload_folder=."
        )
    folder = Path(offload_folder) / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "offloaded.safetensors"
    names = [tensor_name for tensor_name, _ in module.named_parameters() if owning_key(tensor_name, disk_keys)]
    tensors = {tensor_name: module.get_parameter(tensor_name).detach().to("cpu").contiguous()
               for tensor_name in names}
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    index = {tensor_name: {"safetensors_file": str(path), "weight_name": tensor_name,
                           "dtype": str(tensor.dtype).removeprefix("torch.")} for tensor_name, tensor in tensors.items()}
    del tensors
    for tensor_name in names:
        set_module_tensor_to_device(module, tensor_name, "meta")
    return index


__all__ = ["owner_device_map", "read_with_owner"]
