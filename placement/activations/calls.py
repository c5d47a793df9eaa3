"""A call described: the keys an estimate's result depends on, and what the call did, so a replay does it again.

`call_signature`: the inputs' pytree structure, each tensor's layout, dtype and storage size (not its device: an
estimate runs on meta), which inputs share a storage or object, and plain leaves' values; None when a leaf is
anything else (a KV cache, a generator), so such a call is never skipped. `module_state`: everything of a
module tree that can change what its call does, short of weight values (`layer_idx` ignored for blocks:
transformers numbers identical layers with it only to index a KV cache).

A replay must leave behind what the run would have (a causal video VAE decodes frame by frame, replacing
`feat_cache` entries and advancing `feat_idx`): `Entry` notes the inputs as the call begins (tensors by weak
reference, so a replaced cache entry can die), `Effects.of` describes each output leaf and list/dict item against
them ("same", "view", "fresh", "new", "container", "plain") with the input storages it freed, or None when the
call did something a replay could not redo. `Effects.apply` redoes it and raises `ReplayDiverged` unless the
frees and live bytes match the run's. Where a view starts in its storage is not part of the memo's key
(`offsets=False`): no op allocates by it.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .tracking import LiveStorageTracker, storage_key

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, enum.Enum)
# nn.Module's own bookkeeping (hooks are checked separately: `tracking.only_observed`).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
BLOCK_INDEX_ATTRIBUTES = frozenset({"layer_idx"})
_DEPTH = 4  # how deep plain containers (configs) are described: enough for a config's nested lists


def tensor_state(tensor: torch.Tensor) -> tuple:
    # No device: an estimate runs every tensor on meta, whatever it was on.
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype


def call_signature(tree: Any, *, offsets: bool = True) -> Hashable | None:
    """The key of a call's inputs (module doc), or None when a leaf is neither a tensor nor plain. `offsets=False`
    leaves out where each tensor starts in its storage (the block memo's key: see `calls`)."""
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


# The leaves a call's record holds as plain values.
_RECORDED_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class ReplayDiverged(RuntimeError):
    """A replay found the inputs' storages freed otherwise than the run it replays did (module doc)."""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """The inputs of a call as it begins (module doc)."""

    leaves: tuple  # per pytree leaf: a weak reference for a tensor, the value itself otherwise
    keys: tuple  # per leaf: its storage's key for a tensor, None otherwise
    states: tuple  # per leaf: `tensor_state` for a tensor, None otherwise
    containers: tuple | None  # the lists and dicts among the inputs, in walk order; None: another kind of node
    layout: tuple  # per list or dict met in the walk, which of `containers` it is (aliasing is part of the key)

    @classmethod
    def of(cls, inputs: Any) -> "Entry":
        leaves = tree_flatten(inputs)[0]
        tensors = [leaf if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        containers, layout = _containers(inputs)
        return cls(leaves=tuple(weakref.ref(leaf) if tensor is not None else leaf
                                for leaf, tensor in zip(leaves, tensors)),
                   keys=tuple(None if tensor is None else storage_key(tensor) for tensor in tensors),
                   states=tuple(None if tensor is None else tensor_state(tensor) for tensor in tensors),
                   containers=containers, layout=layout)

    def alive(self) -> list:
        """The leaves now; a tensor that died since is None."""
        return [leaf if key is None else leaf() for leaf, key in zip(self.leaves, self.keys)]


def _containers(inputs: tuple[tuple, dict]) -> tuple[tuple | None, tuple]:
    """The lists and dicts in a call's `(args, kwargs)` (each once) and the walk's layout; (None, layout) when a
    node is of another kind (its changes could not be replayed). The `kwargs` dict itself is not one: Python makes
    it for the call, and no caller sees what the callee does to it."""
    found: list = []
    layout: list[int] = []
    args, kwargs = inputs
    plain = all([_walk(node, found, layout) for node in (args, *kwargs.values())])
    return (tuple(found) if plain else None), tuple(layout)


def _walk(node: Any, found: list, layout: list[int]) -> bool:
    # A module-level function, not a closure calling itself: that would be a reference cycle holding `found`, and
    # estimates run with the cyclic collector paused (`isolation.collection_paused`): the lists would stay alive.
    if type(node) in (list, dict):
        index = next((i for i, known in enumerate(found) if known is node), None)
        if index is None:
            index = len(found)
            found.append(node)
        layout.append(index)
        return all([_walk(child, found, layout) for child in (node.values() if isinstance(node, dict) else node)])
    if isinstance(node, tuple):
        return all([_walk(child, found, layout) for child in node])
    return isinstance(node, (torch.Tensor, *_RECORDED_PLAIN))


@dataclass(frozen=True, kw_only=True)
class Effects:
    """A call's outputs and writes, described against its inputs (module doc)."""

    spec: Any
    leaves: tuple  # the output pytree's leaves, described
    items: tuple  # per container: ("list", descriptions) or ("dict", ((key, description), ...))
    storages: tuple[int, ...]  # bytes of each storage the call allocated that several tensors share
    freed: frozenset[int]  # the input leaves whose storages the call freed
    grown: int  # live bytes at the call's exit minus those at its entry

    @classmethod
    def of(cls, output: Any, inputs: Any, entry: Entry, before: frozenset[int], after: frozenset[int],
           grown: int) -> "Effects | None":
        """The description, or None when the call did something a replay could not redo (module doc)."""
        given = entry.alive()
        if not before - after <= set(entry.keys) or not _layouts_kept(given, entry):
            return None
        if entry.containers is None and not _unchanged(inputs, given):
            return None
        contents = () if entry.containers is None else tuple(_contents(c) for c in entry.containers)
        if not all(isinstance(key, _RECORDED_PLAIN) for kind, pairs in contents if kind == "dict" for key, _ in pairs):
            return None  # a key a replay would have to rebuild
        outputs, spec = tree_flatten(output)
        users: dict[int, int] = {}  # storage key -> how many tensors left behind use it
        for leaf in (*outputs, *(item for _, items in contents for _, item in items)):
            if isinstance(leaf, torch.Tensor):
                users[storage_key(leaf)] = users.get(storage_key(leaf), 0) + 1
        if not after - before <= set(users):
            return None  # it left something alive besides its outputs and what it wrote
        describe = _Describer(given, entry.containers or (), after - before, users)
        leaves = tuple(describe(leaf) for leaf in outputs)
        items = tuple((kind, tuple((key, describe(item, nested=True)) for key, item in pairs))
                      for kind, pairs in contents)
        if describe.failed:
            return None
        return cls(spec=spec, leaves=leaves, items=items, storages=describe.storages(),
                   freed=frozenset(i for i, key in enumerate(entry.keys) if key in before - after), grown=grown)

    def apply(self, inputs: Any, tracker: LiveStorageTracker) -> Any:
        """Do it again on `inputs` and return the output: input views first, then the lists and dicts emptied (the
        frees checked), then new storages allocated and filled in, so live bytes never pass the run's peak."""
        entry_bytes = tracker.live_bytes
        containers = _containers(inputs)[0] or ()
        bound, keys = self._bind(inputs)
        for container in containers:
            container.clear()
        alive = tracker.counted_storages()
        if frozenset(i for i, key in enumerate(keys) if key is not None and key not in alive) != self.freed:
            raise ReplayDiverged("a replayed call freed other inputs than the run it replays")
        bases = [torch.empty(nbytes, dtype=torch.uint8, device="meta") for nbytes in self.storages]
        leaves = [_build(what, bound, bases, containers) for what in self.leaves]
        for container, (kind, pairs) in zip(containers, self.items):
            built = [(key, _build(what, bound, bases, containers)) for key, what in pairs]
            if kind == "list":
                container.extend(item for _, item in built)
            else:
                container.update(built)
        if tracker.live_bytes - entry_bytes != self.grown:
            raise ReplayDiverged("a replayed call left other live bytes than the run it replays")
        return tree_unflatten(leaves, self.spec)

    def _bind(self, inputs: Any) -> tuple[dict[int, torch.Tensor], list]:
        """The inputs the description refers to (by leaf index) and every leaf's storage key; nothing else of the
        inputs is held, so emptying the lists frees what the run freed."""
        leaves = tree_flatten(inputs)[0]
        keys = [storage_key(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        bound: dict[int, torch.Tensor] = {}  # id of a "same" or "view" description -> its tensor
        for what in (*self.leaves, *(what for _, pairs in self.items for _, what in pairs)):
            if what[0] == "same":
                bound[id(what)] = leaves[what[1]]
            elif what[0] == "view":
                bound[id(what)] = _view(leaves[what[1]], *what[2:])
        return bound, keys


def _contents(container: list | dict) -> tuple[str, tuple]:
    """A list's items, or a dict's (key, item) pairs."""
    if isinstance(container, dict):
        return "dict", tuple(container.items())
    return "list", tuple((None, item) for item in container)


def _layouts_kept(given: list, entry: Entry) -> bool:
    """Whether every input tensor still alive has the shape, strides and offset it came with."""
    return all(leaf is None or state is None or tensor_state(leaf) == state for leaf, state in zip(given, entry.states))


def _unchanged(inputs: Any, given: list) -> bool:
    """Whether the inputs hold exactly the objects they held when the call began."""
    now = tree_flatten(inputs)[0]
    return len(now) == len(given) and all(a is b for a, b in zip(now, given))


class _Describer:
    """Describes the tensors a call left behind against its inputs (`Effects.of`)."""

    def __init__(self, given: list, containers: tuple, allocated: frozenset[int], users: dict[int, int]) -> None:
        self._given, self._containers = given, containers
        self._allocated, self._users = allocated, users
        self._shared: dict[int, tuple[int, int]] = {}  # storage key -> (index in storages, bytes)
        self._owners: dict[int, int] = {}  # storage key -> the first input tensor alive on it
        self._same: dict[int, int] = {}  # id of an input alive -> its index
        for index, leaf in enumerate(given):
            if isinstance(leaf, torch.Tensor):
                self._owners.setdefault(storage_key(leaf), index)
                self._same.setdefault(id(leaf), index)
        self.failed = False

    def __call__(self, leaf: Any, *, nested: bool = False) -> tuple | None:
        described = self._describe(leaf, nested)
        self.failed |= described is None
        return described

    def storages(self) -> tuple[int, ...]:
        return tuple(nbytes for _, nbytes in sorted(self._shared.values()))

    def _describe(self, leaf: Any, nested: bool) -> tuple | None:
        if nested and type(leaf) in (list, dict):
            index = next((i for i, known in enumerate(self._containers) if known is leaf), None)
            return None if index is None else ("container", index)
        if not isinstance(leaf, torch.Tensor):
            return ("plain", leaf) if isinstance(leaf, _RECORDED_PLAIN) else None
        same = self._same.get(id(leaf))  # ids of inputs alive: no other object can have one
        if same is not None:
            return "same", same
        key, layout = storage_key(leaf), (tuple(leaf.shape), tuple(leaf.stride()))
        owner = self._owners.get(key)
        if owner is not None:
            if self._given[owner].dtype != leaf.dtype:
                return None
            return "view", owner, *layout, leaf.storage_offset() - self._given[owner].storage_offset()
        nbytes = leaf.untyped_storage().nbytes()
        if key not in self._allocated or leaf.device.type != "meta" or nbytes % leaf.element_size():
            return None  # a view of something else alive (a weight, a stashed tensor): not replayable
        if self._users[key] == 1 and leaf.storage_offset() == 0 and nbytes == _strided_bytes(leaf):
            return "fresh", leaf.dtype, *layout  # what empty_strided gives back: one op to rebuild
        index, _ = self._shared.setdefault(key, (len(self._shared), nbytes))
        return "new", index, leaf.dtype, *layout, leaf.storage_offset()


def _view(tensor: torch.Tensor, shape: tuple, stride: tuple, distance: int) -> torch.Tensor:
    offset = tensor.storage_offset() + distance
    extent = sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else -1
    if offset < 0 or (offset + extent + 1) * tensor.element_size() > tensor.untyped_storage().nbytes():
        raise ReplayDiverged("a view a replayed call returns would lie outside its input's storage")
    return tensor.as_strided(shape, stride, offset)


def _build(what: tuple, bound: dict, bases: list, containers: tuple) -> Any:
    kind = what[0]
    if kind == "plain":
        return what[1]
    if kind in ("same", "view"):
        return bound[id(what)]
    if kind == "container":
        return containers[what[1]]
    if kind == "fresh":
        return torch.empty_strided(what[2], what[3], dtype=what[1], device="meta")
    _, index, dtype, shape, stride, offset = what
    return bases[index].view(dtype).as_strided(shape, stride, offset)


def _strided_bytes(tensor: torch.Tensor) -> int:
    """The bytes `torch.empty_strided(tensor.shape, tensor.stride())` allocates."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) \
        * tensor.element_size()
