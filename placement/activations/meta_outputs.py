"""A call's return value made usable outside the estimate: every tensor in it becomes a plain `meta` tensor.

Fake tensors belong to the `FakeTensorMode` that made them; outside it, code that builds on an estimate's
output (the next component's inputs, a pipeline's own `__call__` run on stand-ins) needs tensors it can use
anywhere. Each becomes a meta tensor of the same shape, dtype, strides and storage offset, and tensors that
shared a storage share one again (a diffusers `DiagonalGaussianDistribution`'s `mean` and `logvar` are halves
of its `parameters`). Structures keep their types: tuples, lists, dicts, namedtuples and the registered output
classes (diffusers' `BaseOutput`, transformers' `ModelOutput`) through torch's pytree, and plain objects that
hold tensors as attributes (the distribution above) as shallow copies with their attributes converted.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

_DEPTH = 4  # how deep objects inside objects are looked into


def to_meta(tree: Any) -> Any:
    """`tree` with each tensor replaced by a meta tensor laid out alike (module doc); the rest as it is."""
    bases: dict[int, torch.Tensor] = {}  # id(original storage) -> its meta stand-in, as bytes

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes % tensor.element_size():  # bytes a view of another dtype cannot cover: lay it out alone
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        if id(storage) not in bases:
            bases[id(storage)] = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        base = bases[id(storage)].view(tensor.dtype)
        return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    return map_tensors(convert, tree)


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], tree: Any, depth: int = 0) -> Any:
    """`tree` with `function` applied to each tensor, in pytree containers and in plain objects' attributes."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return function(value)
        attributes = getattr(value, "__dict__", None)
        if depth >= _DEPTH or not isinstance(attributes, dict) or isinstance(value, (nn.Module, type)) \
                or callable(value):
            return value
        converted = {name: map_tensors(function, item, depth + 1) for name, item in attributes.items()}
        if all(converted[name] is item for name, item in attributes.items()):
            return value  # nothing inside to convert: the object itself
        duplicate = copy.copy(value)
        vars(duplicate).update(converted)  # through __dict__: frozen dataclasses too
        return duplicate

    return tree_map(leaf, tree)
