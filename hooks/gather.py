"""Read a placed module's weights from wherever they live, without changing its placement.

A placed module does not always hold its weights. Where a technique keeps them elsewhere, the module holds a
`meta` placeholder of the right shape and dtype between calls:
- accelerate's offloading `AlignDevicesHook`s (our `ServeWeightsHook`: the "cpu" and "disk" entries of a device
  map, sequential offload; accelerate's own `dispatch_model` / `cpu_offload` / `disk_offload` hooks on a component
  its owner placed) serve them from the hook's `weights_map`: a CPU state dict, or an offload index into
  safetensors files (a checkpoint's own files, or an offload folder);
- group offloading and per-call residency (`ModuleGroup`s) keep a resting group in a `DiskStore` (one safetensors
  file per group) or a `CheckpointStore` (a checkpoint's "disk" weights). Groups homed in host memory leave real
  CPU tensors in the module, and resident or onloaded weights are real too: those need no gathering.

Each technique's row says how its placeholders are gathered (`TechniqueSpec.gather`: `served_slots` for the hooks'
`weights_map`s, `group_slots` for offload groups); `offloaded_weights(module)` asks every row, and returns a lazy
mapping {state-dict name: the weight read into CPU memory}, so a writer can read them one shard at a time;
`offloaded_weights_in_state_dict(module)` makes `module.state_dict()` return the real weights while it is open, for
writers that call `state_dict()` themselves (diffusers' and transformers' `save_pretrained`). Nothing moves: no hook
fires, no group is onloaded, the transfer meter counts nothing, and the placement is the same afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate.hooks import AlignDevicesHook
from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from .hook_utils import find_hooks
from .techniques import TECHNIQUES

if TYPE_CHECKING:  # the techniques' files import this one for their rows' `gather`
    from .group_offload.module_group import ModuleGroup

SlotKey = tuple[int, str]  # (id of the module holding the tensor, its attribute name)


class _ServedWeight:
    """A weight an offloading `AlignDevicesHook` serves: `key` in its `weights_map`."""

    def __init__(self, weights_map: Mapping, key: str) -> None:
        self.weights_map = weights_map
        self.key = key

    def read(self, cache: "_LastGroup | None" = None) -> torch.Tensor:
        return read_into_memory(self.weights_map, self.key)


class _GroupWeight:
    """A weight resting in an offload group's store; the group's tensors are read once for all its weights
    (`cache`: the reader's last group)."""

    def __init__(self, group: ModuleGroup, key: str) -> None:
        self.group = group
        self.key = key

    def read(self, cache: "_LastGroup | None" = None) -> torch.Tensor:
        return (cache or _LastGroup()).tensors_of(self.group)[self.key].to("cpu")


class _LastGroup:
    """The tensors of the last group read: writers go through a state dict in order, and a group's tensors are
    neighbours there, so each group is read about once while at most one group's weights are held."""

    def __init__(self) -> None:
        self.group: ModuleGroup | None = None
        self.tensors: Mapping[str, torch.Tensor] = {}

    def tensors_of(self, group: ModuleGroup) -> Mapping[str, torch.Tensor]:
        if group is not self.group:
            self.group, self.tensors = None, {}  # drop the previous group's tensors before reading the next
            self.tensors = dict(group.store.read(pinned=False))
            self.group = group
        return self.tensors


Source = _ServedWeight | _GroupWeight


class OffloadedWeights(Mapping[str, torch.Tensor]):
    """{state-dict name: weight} for every tensor a placed module holds as a placeholder; each weight is read
    into CPU memory when it is looked up (tied names share one source: `source_of(name)` tells them apart)."""

    def __init__(self, sources: Mapping[str, Source]) -> None:
        self._sources = dict(sources)
        self._cache = _LastGroup()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].read(self._cache)

    def read(self, source: Source) -> torch.Tensor:
        """`source` (one of `source_of`'s) read into CPU memory."""
        return source.read(self._cache)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def source_of(self, name: str) -> Source:
        return self._sources[name]


def offloaded_weights(module: nn.Module) -> OffloadedWeights:
    """The weights `module` holds as `meta` placeholders and where each is read from (see the module docstring).
    A placeholder nothing serves (a weight never loaded) is not in it: `unserved_placeholders` names those."""
    slots: dict[SlotKey, Source] = {}
    for gather in dict.fromkeys(row.gather for row in TECHNIQUES.values() if row.gather is not None):
        slots.update(gather(module))
    sources: dict[str, Source] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for attribute in [*submodule._parameters, *submodule._buffers]:
            source = slots.get((id(submodule), attribute))
            if source is not None:
                sources[f"{prefix}.{attribute}" if prefix else attribute] = source
    return OffloadedWeights(sources)


def unserved_placeholders(module: nn.Module, weights: OffloadedWeights) -> list[str]:
    """State-dict names of `module` on `meta` that `weights` does not serve: weights that were never loaded."""
    return [name for name, tensor in module.state_dict().items() if tensor.is_meta and name not in weights]


@contextmanager
def offloaded_weights_in_state_dict(module: nn.Module) -> Iterator[OffloadedWeights]:
    """While open, `module.state_dict()` holds every offloaded weight read into CPU memory instead of its
    placeholder (tied names get one tensor, as they share one in the module). All of them are read at each
    `state_dict()` call: writers that take the whole state dict at once need them all at once."""
    weights = offloaded_weights(module)

    def fill_in(_module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        read: dict[int, torch.Tensor] = {}
        for name in weights:
            key, source = prefix + name, weights.source_of(name)
            if key in state_dict and state_dict[key].is_meta:
                if id(source) not in read:
                    read[id(source)] = weights.read(source)
                state_dict[key] = read[id(source)]

    handle = module.register_state_dict_post_hook(fill_in)
    try:
        yield weights
    finally:
        handle.remove()


def read_into_memory(weights_map: Mapping, key: str) -> torch.Tensor:
    """`weights_map[key]` as a CPU tensor. An offload index is read straight into memory: the hook's own loader
    may read onto its execution device, which a save does not need."""
    base, full_key = _unwrap(weights_map, key)
    if isinstance(base, OffloadedWeightsLoader) and full_key not in base.state_dict:
        one = OffloadedWeightsLoader(index={full_key: base.index[full_key]}, save_folder=base.save_folder)
        return one[full_key]
    return base[full_key].to("cpu")


def served_slots(module: nn.Module) -> dict[SlotKey, Source]:
    """The placeholders under `module` that offloading `AlignDevicesHook`s serve from their `weights_map`
    (ours, and accelerate's own on a component its owner placed)."""
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
    """The placeholders that `groups` keep in their stores (a tied tensor: one entry, several slots)."""
    slots: dict[SlotKey, Source] = {}
    for group in groups:
        for entry in group.entries:
            if entry.get().is_meta:
                source = _GroupWeight(group, entry.key)
                for slot in entry.slots:
                    slots[(id(slot.module), slot.name)] = source
    return slots


def _unwrap(weights_map: Mapping, key: str) -> tuple[Mapping, str]:
    while isinstance(weights_map, PrefixedDataset):
        weights_map, key = weights_map.dataset, f"{weights_map.prefix}{key}"
    return weights_map, key


def _serves(weights_map: Mapping, key: str) -> bool:
    """Whether `weights_map` has `key`, without reading it (a `PrefixedDataset`'s `in` would)."""
    base, full_key = _unwrap(weights_map, key)
    if isinstance(base, OffloadedWeightsLoader):
        return full_key in base.state_dict or full_key in base.index
    return full_key in base


__all__ = ["OffloadedWeights", "group_slots", "offloaded_weights", "offloaded_weights_in_state_dict",
           "read_into_memory", "served_slots", "unserved_placeholders"]
