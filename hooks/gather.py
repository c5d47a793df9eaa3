"""Read a placed module's weights from wherever they live, without changing its placement (for saving).

Where a technique keeps weights elsewhere the module holds `meta` placeholders; each row's `gather` says where
they are read from (`served_slots`: offloading `AlignDevicesHook`s' `weights_map`s; `group_slots`: offload
groups' disk stores); diffusers' own disk group offloading is read from its groups' files (`diffusers_disk_slots`). Nothing moves: no hook fires, no group is onloaded, the transfer meter counts nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate.hooks import AlignDevicesHook
from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset
from accelerate.utils.modeling import named_module_tensors
from safetensors import safe_open
from torch import nn

from .hook_utils import find_hooks
from .techniques import TECHNIQUES

if TYPE_CHECKING:  # the techniques' files import this one for their rows' `gather`
    from .group_offload.module_group import ModuleGroup

SlotKey = tuple[int, str]  # (id of the module holding the tensor, its attribute name)


class _ServedWeight:
    def __init__(self, weights_map: Mapping, key: str) -> None:
        self.weights_map = weights_map
        self.key = key

    def read(self, cache: "_LastGroup | None" = None) -> torch.Tensor:
        return read_into_memory(self.weights_map, self.key)


class _GroupWeight:
    def __init__(self, group: ModuleGroup, key: str) -> None:
        self.group = group
        self.key = key

    def read(self, cache: "_LastGroup | None" = None) -> torch.Tensor:
        return (cache or _LastGroup()).tensors_of(self.group)[self.key].to("cpu")


class _LastGroup:
    """The last group's tensors: writers go through a state dict in order, where a group's tensors are
    neighbours, so each group is read about once while at most one group's weights are held."""

    def __init__(self) -> None:
        self.group: ModuleGroup | None = None
        self.tensors: Mapping[str, torch.Tensor] = {}

    def tensors_of(self, group: ModuleGroup) -> Mapping[str, torch.Tensor]:
        if group is not self.group:
            self.group, self.tensors = None, {}  # drop the previous group's tensors before reading the next
            self.tensors = dict(group.store.read(pinned=False))
            self.group = group
        return self.tensors


class _DiffusersDiskWeight:
    """A tensor of a group diffusers' own `enable_group_offload(offload_to_disk_path=...)` wrote to its file: the
    module keeps an uninitialised placeholder of the right shape (not `meta`), so it is always read from the file."""

    def __init__(self, path: str, key: str) -> None:
        self.path = path
        self.key = key

    def read(self, cache: "_LastGroup | None" = None) -> torch.Tensor:
        with safe_open(self.path, framework="pt", device="cpu") as file:
            return file.get_tensor(self.key)


Source = _ServedWeight | _GroupWeight | _DiffusersDiskWeight
_DIFFUSERS_GROUP_HOOK = "group_offloading"  # diffusers.hooks.group_offloading._GROUP_OFFLOADING


class OffloadedWeights(Mapping[str, torch.Tensor]):
    """{state-dict name: weight read into CPU memory when looked up} for a placed module's placeholders (tied
    names share one `source_of(name)`)."""

    def __init__(self, sources: Mapping[str, Source]) -> None:
        self._sources = dict(sources)
        self._cache = _LastGroup()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].read(self._cache)

    def read(self, source: Source) -> torch.Tensor:
        return source.read(self._cache)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def source_of(self, name: str) -> Source:
        return self._sources[name]


def offloaded_weights(module: nn.Module) -> OffloadedWeights:
    """The weights `module` holds as `meta` placeholders (those nothing serves: `unserved_placeholders`)."""
    slots: dict[SlotKey, Source] = {}
    for gather in dict.fromkeys(row.gather for row in TECHNIQUES.values() if row.gather is not None):
        slots.update(gather(module))
    slots.update(diffusers_disk_slots(module))
    sources: dict[str, Source] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for attribute in [*submodule._parameters, *submodule._buffers]:
            source = slots.get((id(submodule), attribute))
            if source is not None:
                sources[f"{prefix}.{attribute}" if prefix else attribute] = source
    return OffloadedWeights(sources)


def diffusers_disk_slots(module: nn.Module) -> dict[SlotKey, Source]:
    """The tensors of `module` that diffusers' disk group offloading keeps in its groups' files (`ModuleGroup.
    tensor_to_key` into `safetensors_file_path`), once written there."""
    files: dict[int, tuple[str, str]] = {}
    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        hook = None if registry is None else registry.hooks.get(_DIFFUSERS_GROUP_HOOK)
        group = getattr(hook, "group", None)
        path = getattr(group, "safetensors_file_path", None)
        if getattr(group, "offload_to_disk_path", None) and path and os.path.exists(path):
            files.update({id(tensor): (path, key) for tensor, key in group.tensor_to_key.items()})
    if not files:
        return {}
    return {(id(owner), attribute): _DiffusersDiskWeight(*files[id(tensor)])
            for owner in module.modules() for attribute, tensor in [*owner._parameters.items(), *owner._buffers.items()]
            if tensor is not None and id(tensor) in files}


def unserved_placeholders(module: nn.Module, weights: OffloadedWeights) -> list[str]:
    """State-dict names of `module` on `meta` that `weights` does not serve: weights that were never loaded."""
    return [name for name, tensor in module.state_dict().items() if tensor.is_meta and name not in weights]


@contextmanager
def offloaded_weights_in_state_dict(module: nn.Module) -> Iterator[OffloadedWeights]:
    """While open, `module.state_dict()` holds every offloaded weight read into CPU memory instead of its
    placeholder (for writers that call `state_dict()` themselves: diffusers', transformers' `save_pretrained`)."""
    weights = offloaded_weights(module)

    def fill_in(_module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        read: dict[int, torch.Tensor] = {}
        for name in weights:
            key, source = prefix + name, weights.source_of(name)
            if key in state_dict and (state_dict[key].is_meta or isinstance(source, _DiffusersDiskWeight)):
                if id(source) not in read:
                    read[id(source)] = weights.read(source)
                state_dict[key] = read[id(source)]

    handle = module.register_state_dict_post_hook(fill_in)
    try:
        yield weights
    finally:
        handle.remove()


def read_into_memory(weights_map: Mapping, key: str) -> torch.Tensor:
    """`weights_map[key]` as a CPU tensor (an index read straight into memory, not onto the hook's device)."""
    base, full_key = unwrap(weights_map, key)
    if isinstance(base, OffloadedWeightsLoader) and full_key not in base.state_dict:
        one = type(base)(index={full_key: base.index[full_key]}, save_folder=base.save_folder)  # checks kept
        return one[full_key]
    return base[full_key].to("cpu")


def served_slots(module: nn.Module) -> dict[SlotKey, Source]:
    """The placeholders under `module` that offloading `AlignDevicesHook`s serve (ours, and accelerate's own)."""
    slots: dict[SlotKey, Source] = {}
    by_tensor: dict[int, Source] = {}  # tied parameters (one Parameter in two modules) share one source
    for _, submodule, hook in find_hooks(module, AlignDevicesHook):
        if not hook.offload or hook.weights_map is None:
            continue
        for name, tensor in named_module_tensors(submodule, include_buffers=hook.offload_buffers,
                                                 recurse=hook.place_submodules):
            if not tensor.is_meta or not _serves(hook.weights_map, name):
                continue
            owner_path, _, attribute = name.rpartition(".")
            owner = submodule.get_submodule(owner_path)
            source = by_tensor.setdefault(id(tensor), _ServedWeight(hook.weights_map, name))
            slots[(id(owner), attribute)] = source
    return slots


def group_slots(groups: Iterable[ModuleGroup]) -> dict[SlotKey, Source]:
    slots: dict[SlotKey, Source] = {}
    for group in groups:
        for entry in group.entries:
            if entry.get().is_meta:
                source = _GroupWeight(group, entry.key)
                for slot in entry.slots:
                    slots[(id(slot.module), slot.name)] = source
    return slots


def unwrap(weights_map: Mapping, key: str) -> tuple[Mapping, str]:
    while isinstance(weights_map, PrefixedDataset):
        weights_map, key = weights_map.dataset, f"{weights_map.prefix}{key}"
    return weights_map, key


def _serves(weights_map: Mapping, key: str) -> bool:
    """Whether `weights_map` has `key`, without reading it (a `PrefixedDataset`'s `in` would)."""
    base, full_key = unwrap(weights_map, key)
    if isinstance(base, OffloadedWeightsLoader):
        return full_key in base.state_dict or full_key in base.index
    return full_key in base


__all__ = ["OffloadedWeights", "group_slots", "offloaded_weights", "offloaded_weights_in_state_dict",
           "read_into_memory", "served_slots", "unserved_placeholders"]
