"""What an estimate's result depends on, as hashable keys: a call's inputs and a module's state.

`call_signature((args, kwargs))`: the structure (a pytree spec: tuples, dicts, namedtuples, registered output
classes), each tensor's shape, strides, storage offset, dtype and storage size (not its device: an estimate
runs on meta whatever it was on), which inputs share a storage or are the same object, and the values of
plain leaves (numbers, strings, dtypes...). None when a leaf is anything else (a KV cache, a generator): such
a call is never skipped, since we cannot tell what it would do.

`module_state(module)`: everything of a module tree that can change what its call does, short of weight values:
per submodule its class, its parameters' and buffers' shapes/dtypes/strides, its plain attributes (a VAE's
`use_tiling`, `training`, a dropout's `p`), the type of any other attribute (an attention processor) and the
function behind any function attribute. Two blocks with equal states run the same code on the same shapes.
`layer_idx` is left out for blocks (`ignore=`): transformers numbers its otherwise identical layers with it, to
index a KV cache, which comes in as an argument and so makes the call unskippable anyway.
"""

from __future__ import annotations

import enum
from typing import Any, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, enum.Enum)
# nn.Module's own bookkeeping (hooks are checked separately: `observers.only_observed`).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
BLOCK_INDEX_ATTRIBUTES = frozenset({"layer_idx"})
_DEPTH = 4  # how deep plain containers (configs) are described: enough for a config's nested lists


def tensor_state(tensor: torch.Tensor) -> tuple:
    # No device: an estimate runs every tensor on meta, whatever it was on.
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype


def call_signature(tree: Any, *, offsets: bool = True) -> Hashable | None:
    """The key of a call's inputs (module doc), or None when a leaf is neither a tensor nor plain. `offsets=False`
    leaves out where each tensor starts in its storage (the block memo's key: see `call_effects`)."""
    leaves, spec = tree_flatten(tree)
    storages: dict[int, int] = {}
    objects: dict[int, int] = {}
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            try:
                storage = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                return None
            state = tensor_state(leaf) if offsets else (*tensor_state(leaf)[:2], leaf.dtype)
            parts.append((state, storage.nbytes(), storages.setdefault(id(storage), len(storages)),
                          objects.setdefault(id(leaf), len(objects))))
        elif isinstance(leaf, _PLAIN):
            parts.append((type(leaf), leaf))  # the type too: 1, 1.0 and True are equal keys otherwise
        else:
            return None
    return spec, tuple(parts)


def module_state(module: nn.Module, *, ignore: frozenset[str] = frozenset()) -> tuple:
    """The state of `module` and its submodules that a call depends on (module doc), with relative paths."""
    seen: dict[int, Hashable] = {}  # id -> description of objects met more than once (a config every layer holds)
    return tuple(_own_state(path, sub, ignore, seen) for path, sub in module.named_modules())


def _own_state(path: str, module: nn.Module, ignore: frozenset[str], seen: dict) -> tuple:
    tensors = tuple((name, None if value is None else tensor_state(value))
                    for name, value in (*module._parameters.items(), *module._buffers.items()))
    attributes = tuple((name, describe(value, seen=seen)) for name, value in module.__dict__.items()
                       if name not in _MODULE_INTERNALS and name not in ignore)
    return path, type(module), tensors, attributes, module.training


def describe(value: Any, depth: int = 0, *, seen: dict | None = None) -> Hashable:
    """A hashable description of an attribute: plain values as they are, containers and plain objects (a
    transformers config, an attention processor) item by item down to a depth, a tensor by its state, a function
    by its qualified name, a module or anything deeper by its type."""
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, torch.Tensor):
        return torch.Tensor, tensor_state(value)
    function = getattr(value, "__func__", value)
    if callable(function) and hasattr(function, "__qualname__") and not isinstance(function, type):
        return "function", getattr(function, "__module__", None), function.__qualname__
    if depth >= _DEPTH or isinstance(value, (nn.Module, type)):
        return "object", type(value)
    seen = {} if seen is None else seen
    if id(value) not in seen:
        seen[id(value)] = _describe_items(value, depth, seen)
    return seen[id(value)]


def _describe_items(value: Any, depth: int, seen: dict) -> Hashable:
    if isinstance(value, (tuple, list, frozenset, set)):
        items = tuple(describe(item, depth + 1, seen=seen) for item in value)
        return type(value), tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return type(value), tuple((repr(key), describe(item, depth + 1, seen=seen)) for key, item in value.items())
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return type(value), _describe_items(attributes, depth, seen)
    return "object", type(value)
