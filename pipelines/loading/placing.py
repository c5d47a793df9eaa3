"""Placing a component built on meta: its weights read to the devices its plan gives (our streaming reader, or
the format's owner library given our map, its own hooks then replaced by ours), then the runtime of its
placement kind; one undo when anything fails. The owner loads onto real accelerators only: virtual ones and
"disk" are ours, so those entries are loaded to the CPU and moved or written after."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import safetensors.torch
import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from hooks.dispatch import DiskWeights, undispatch
from hooks.pinned_files import IDENTITY_KEY, pin_checkpoint_files
from hooks.techniques import apply_component_plan, apply_plan
from placement.device_maps import flatten_device_map, owning_key
from placement.devices import Accelerators, Device, is_accelerator, normalize_device, torch_device
from placement.errors import InvalidDeviceError
from placement.plan_schema import ComponentPlan, Plan

from ..checkpoint import stream_weights
from ..errors import PipelineLoadError
from ..hf.owner_loading import OwnerLoad, load_with_owner, remove_owner_state
from .meta import MetaComponent, WeightsReader, apply_casting
from .request import DeviceMapKind, DeviceMapRequest


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
    """The plan's map in the owner's terms: real accelerators as torch devices, everything else the CPU. The CPU is
    `torch.device("cpu")`, never "cpu", which the owners' quantizers read as offloaded (unquantized or refused)."""
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


def move_entries(module: nn.Module, flat: Mapping[str, Device], accelerators: Accelerators, *,
                 to_cpu: bool = False) -> None:
    """Every accelerator entry of the plan (and with `to_cpu` every CPU entry) moved to its device, tensors as they
    are (quantized ones keep their format: `.to()` of a torchao/quanto/bitsandbytes tensor moves its inner data
    and scales). Shorter keys first: a longer key inside one wins."""
    for path, device in sorted(flat.items(), key=lambda item: len(item[0])):
        if not (is_accelerator(device) or (to_cpu and device == "cpu")):
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
    their offload index. Buffers stay in RAM."""
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


def check_plan_devices(plan: Plan, accelerators: Accelerators) -> None:
    """Before anything is read: every accelerator the plan uses exists here."""
    absent_by_component = {
        name: sorted({d for d in [*c.devices, c.execution_device] if is_accelerator(d) and d >= accelerators.count})
        for name, c in plan.components.items()
    }
    absent = sorted({d for devices in absent_by_component.values() for d in devices})
    if absent:
        names = ", ".join(name for name, devices in absent_by_component.items() if devices)
        raise InvalidDeviceError(
            f"The plan puts {names} on accelerator(s) {absent}, but this machine has {accelerators.count} "
            "accelerator(s). To see where it would go on other hardware, call plan_placement(...) instead; to load "
            "here, give max_memory only for the accelerators present (or device_map='cpu'); to run this plan's "
            "code paths on CPU-backed accelerators, set PLACEMENT_VIRTUAL_ACCELERATORS=N (a test mode)."
        )


def check_requested_devices(device_map: DeviceMapRequest, accelerators: Accelerators) -> None:
    """Before anything is built: a `device_map` naming an accelerator this machine lacks is an error, never a silent
    load onto the CPU."""
    if device_map.kind not in (DeviceMapKind.SINGLE_DEVICE, DeviceMapKind.PINS):
        return
    absent = sorted({device for device in _named_devices(device_map.value)
                     if is_accelerator(device) and device >= accelerators.count})
    if not absent:
        return
    have = ("no accelerator (no CUDA, XPU or MPS device is visible)" if accelerators.count == 0 else
            f"{accelerators.count} accelerator(s): GPU {', GPU '.join(map(str, range(accelerators.count)))}")
    spelled = dict(device_map.value) if isinstance(device_map.value, Mapping) else device_map.value
    raise InvalidDeviceError(
        f"device_map={spelled!r} asks for {', '.join(f'GPU {d}' for d in absent)} (no GPU for "
        f"{', '.join(repr(f'cuda:{d}') for d in absent)}), but this machine has {have}. Load onto what is here "
        "(device_map='cpu', or a strategy such as 'balanced'); to see where it would go on other hardware, call "
        "plan_placement(...) with max_memory for those GPUs; PLACEMENT_VIRTUAL_ACCELERATORS=N gives N CPU-backed "
        "accelerators to try it on (a test mode)."
    )


def _named_devices(value) -> list[Device]:
    """Every device a device_map value names (nested pins included); a spelling that is no device is skipped
    here: the planner reports it."""
    if isinstance(value, Mapping):
        return [device for inner in value.values() for device in _named_devices(inner)]
    try:
        return [normalize_device(value)]
    except InvalidDeviceError:
        return []


def place_component(meta: MetaComponent, component: ComponentPlan | None, *, accelerators: Accelerators,
                    hooks: bool = True, progress: bool = True, offload_folder: str | Path | None = None) -> nn.Module:
    """Read `meta`'s weights to the devices `component` plans, then attach its runtime (`component=None`: to the
    CPU, no runtime). Returns the placed module, the owner's when the owner reads it. A failure leaves the module
    hook-free with every tensor on meta."""
    module, disk_weights = read_component(meta, component, accelerators=accelerators, progress=progress,
                                          offload_folder=offload_folder)
    if component is not None:
        try:
            attach_runtime(module, component, hooks=hooks, disk_weights=disk_weights)
        except BaseException:
            _unplace_quietly(module)
            raise
    return module


def read_component(meta: MetaComponent, component: ComponentPlan | None, *, accelerators: Accelerators,
                   progress: bool = True, offload_folder: str | Path | None = None,
                   ) -> tuple[nn.Module, DiskWeights | None]:
    """`meta`'s weights read to the devices `component` plans, cast, no runtime: the module and what serves its "disk"
    parts. A failure leaves the module hook-free with every tensor on meta."""
    device_map = None if component is None else component.device_map
    module = meta.module
    try:
        if meta.reader is WeightsReader.OWNER:
            module, disk_weights = read_with_owner(meta, device_map, accelerators=accelerators,
                                                   offload_folder=offload_folder)
        else:
            disk_weights = _stream(meta, device_map, accelerators=accelerators, progress=progress,
                                   offload_folder=offload_folder)
        apply_casting(module, meta)
    except BaseException:
        _unplace_quietly(module)
        raise
    return module, disk_weights


def _unplace_quietly(module: nn.Module) -> None:
    try:
        unplace(module)
    except Exception:  # e.g. a quantized module that refuses .to("meta"): the original error matters
        pass


def attach_runtime(module: nn.Module, component: ComponentPlan, *, hooks: bool,
                   disk_weights: DiskWeights | None = None) -> None:
    """The runtime of the component's placement kind (`hooks.techniques.apply_component_plan`); `hooks=False`
    (a single-device strategy: the weights already sit where they run) only records the map."""
    if hooks:
        apply_component_plan(module, component, disk_weights=disk_weights)
    else:
        module.hf_device_map = dict(component.device_map)


def attach_plan_runtime(modules: Mapping[str, nn.Module], plan: Plan, *, hooks: bool,
                        disk_weights: Mapping[str, DiskWeights | None]) -> None:
    """A pipeline's runtime at once (`hooks.apply_plan`), so the components sharing an accelerator share one per-call
    coordinator; `modules`: those placed here (the plan's others are pinned where their owner placed them)."""
    if not hooks:
        for name, module in modules.items():
            module.hf_device_map = plan.component_device_map(name)
        return
    apply_plan(modules, plan, disk_weights={name: disk_weights.get(name) for name in modules},
               placed_by_owner=[name for name in plan.components if name not in modules])


def unplace(module: nn.Module, *, to: torch.device | str = "meta") -> None:
    """The one undo of a placement: every hook removed (offload ones too), every tensor moved `to` ("meta"
    frees what a load read; a module passed in goes back where it was), no device map."""
    undispatch(module)
    module.to(to)
    if hasattr(module, "hf_device_map"):
        module.hf_device_map = None


def _stream(meta: MetaComponent, device_map: Mapping[str, Device] | None, *, accelerators: Accelerators,
            progress: bool, offload_folder: str | Path | None = None) -> DiskWeights | None:
    """Our reader: each tensor from its safetensors file straight to its device, in its load dtype; the disk
    part served from the checkpoint's own files (the offload index returned)."""
    if meta.weights is None:
        raise PipelineLoadError(f"Component {meta.name!r} was built without weights (for planning); it cannot be "
                                "loaded. Build it with its weights required.")
    stream_weights(meta.module, meta.weights, device_map=device_map, load_dtypes=meta.load_dtypes,
                   tied_weights=meta.tied_weights, progress=progress, label=meta.name, accelerators=accelerators)
    return disk_offload_index(meta, device_map, offload_folder=offload_folder)


def disk_offload_index(meta: MetaComponent, device_map: Mapping[str, Device] | None, *,
                       offload_folder: str | Path | None = None) -> DiskWeights | None:
    """Every parameter `device_map` puts on "disk", served from its checkpoint file in its load dtype; a tied one by
    its source, even when the source is not on disk (accelerate's hook asks for it by the tied name). Pinned to the
    version loaded (`hooks.pinned_files`): each entry carries its file's identity, and the files are hard-linked
    into `offload_folder` where it shares their filesystem."""
    disk = [name for name, device in (device_map or {}).items() if normalize_device(device) == "disk"]
    if not disk:
        return None
    sources = {}
    for name, _ in meta.module.named_parameters(remove_duplicate=False):
        if owning_key(name, disk) is not None:
            source = name if name in meta.weights.tensors else meta.tied_weights.get(name)
            if source is not None:
                sources[name] = source
    index = meta.weights.offload_index(sources, lambda entry: meta.load_dtypes[entry.name])
    identities = meta.weights.identities
    for info in index.values():
        identity = identities.get(Path(info["safetensors_file"]))
        if identity is not None:
            info[IDENTITY_KEY] = dict(identity)
    return pin_checkpoint_files(index, offload_folder, owner=meta.module)
