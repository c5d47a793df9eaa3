"""What the editors of placed modules share (see `editing`): opening offload groups for an edit, and settling
the tensors that no technique serves onto the device their device-map entry names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from accelerate.utils import set_module_tensor_to_device
from torch import nn

from placement.device_maps import owning_key
from placement.devices import Device, is_accelerator, torch_device

from .group_offload.module_group import ModuleGroup
from .input_moving import is_on
from .stand_ins import StandIns


def open_groups(root: nn.Module, groups: Iterable[ModuleGroup], stand_ins: StandIns) -> None:
    """Every group offloaded, so `root` holds each weight's stored form (host tensors in place: edits write
    into the store itself), and disk-homed placeholders replaced by stand-ins."""
    groups = list(groups)
    for group in groups:
        group.reset()
    names = {id(tensor): name for name, tensor in named_tensors(root)}
    for group in groups:
        for entry in group.entries:
            if entry.get().is_meta:
                stand_ins.put(names.get(id(entry.get()), entry.key), entry.slots)


def store_home(group: ModuleGroup, entry) -> Device:
    """Where one of a group's tensors lives between uses, as its store keeps it ("disk": read from files, the
    checkpoint's own or the offload folder; else "cpu"). By the store, not by the tensor: a group loaded for its
    phase holds device tensors, and their home is still the disk."""
    return group.store.home_of(entry.key)


def named_tensors(module: nn.Module):
    """Every parameter and buffer with its qualified name, tied ones under each of their names."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def settle(root: nn.Module, device_map: Mapping[str, Device], main: Device, covered: set[int]) -> tuple[
        list[tuple[str, nn.Module]], list[str]]:
    """Put each tensor of `root` that no technique serves (`covered`: ids of served / grouped tensors) on the
    device of its device-map entry, when that entry is resident (an accelerator, or the CPU that executes).
    Returns the modules holding such tensors in streamed entries (host-homed while `main` executes), for the
    caller to serve, and the names of tensors that have no data (meta) and nothing to serve them."""
    streamed: list[tuple[str, nn.Module]] = []
    no_data: list[str] = []
    mapped = mapped_homes(root, device_map)
    for path, module in root.named_modules():
        direct = [(name, tensor) for name, tensor in _direct_tensors(module) if id(tensor) not in covered]
        if not direct:
            continue
        prefix = f"{path}." if path else ""
        homes = {name: mapped.get(id(tensor), device_map.get("", "cpu")) for name, tensor in direct}
        no_data += [prefix + name for name, tensor in direct if tensor.is_meta]
        if any(is_streamed(home, main) for home in homes.values()):
            streamed.append((path, module))
            continue
        for name, tensor in direct:
            device = torch_device(homes[name])
            if not tensor.is_meta and not is_on(tensor, device):
                set_module_tensor_to_device(module, name, device)
    return streamed, no_data


def is_streamed(home: Device, main: Device) -> bool:
    """Weights homed off the executing device: on disk, or in RAM while an accelerator executes."""
    return home == "disk" or (home == "cpu" and is_accelerator(main))


def mapped_homes(root: nn.Module, device_map: Mapping[str, Device]) -> dict[int, Device]:
    """Each tensor's device-map home, by identity: a tied tensor (T5's `encoder.embed_tokens` is `shared`) is
    homed by whichever of its names the map covers, so the alias the map does not name is not taken for a
    tensor of the root entry."""
    homes: dict[int, Device] = {}
    for name, tensor in named_tensors(root):
        key = owning_key(name, device_map)
        if key is not None:
            homes.setdefault(id(tensor), device_map[key])
    return homes


def _direct_tensors(module: nn.Module) -> Sequence[tuple[str, object]]:
    return [*((n, t) for n, t in module._parameters.items() if t is not None),
            *((n, t) for n, t in module._buffers.items() if t is not None)]


__all__ = ["is_streamed", "mapped_homes", "named_tensors", "open_groups", "settle"]
