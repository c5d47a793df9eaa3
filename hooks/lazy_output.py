"""A result still being computed on another thread (the first guidance branch of a step, on the replica's GPU),
handed to the pipeline at once so that it can launch the second branch while the first computes.

What diffusers' true-CFG loops do with the first output before the second call is pick it out (`[0]`, `.sample`)
and at most slice it (Qwen-Image drops its image tokens: `noise_pred[:, :seq]`); both are deferred here. Any other
use (arithmetic, a torch function, an attribute) waits for the branch, gathers its outputs on the execution device
and acts on the real tensors, so a pipeline that uses the output earlier gets the same numbers, only later."""

from __future__ import annotations

import operator
from concurrent.futures import Future
from typing import Any, Callable

from torch.utils._pytree import tree_map

# The deferred steps from the branch's whole output to what the pipeline holds: picks and slices.
_Step = Callable[[Any], Any]
_MISSING = object()


class _Branch:
    """The branch's whole output, gathered once however many parts of it the pipeline holds."""

    def __init__(self, future: Future, gather: Callable[[Any], Any]) -> None:
        self.future, self._gather = future, gather
        self._value: Any = _MISSING

    def value(self) -> Any:
        if self._value is _MISSING:
            self._value = self._gather(self.future.result())
        return self._value


class LazyOutput:
    """The branch's output, or a part of it (`steps` applied to it once it is there)."""

    def __init__(self, future: Future, gather: Callable[[Any], Any], steps: tuple[_Step, ...] = (), *,
                 branch: _Branch | None = None) -> None:
        self._branch = branch or _Branch(future, gather)
        self._steps = steps
        self._value: Any = _MISSING

    def resolve(self) -> Any:
        """Wait for the branch, gather its output (once) and apply the deferred steps (once)."""
        if self._value is _MISSING:
            value = self._branch.value()
            for step in self._steps:
                value = step(value)
            self._value = value
        return self._value

    def _then(self, step: _Step) -> "LazyOutput":
        return LazyOutput(self._branch.future, None, (*self._steps, step), branch=self._branch)

    def __getitem__(self, key: Any) -> "LazyOutput":
        return self._then(lambda value: value[key])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("sample", "images", "frames"):  # the output's fields (a diffusers BaseOutput)
            return self._then(operator.attrgetter(name))
        return getattr(self.resolve(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = resolved((args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        state = "done" if self._branch.future.done() else "computing"
        return f"LazyOutput({state}, {len(self._steps)} deferred step(s))"


def resolved(value: Any) -> Any:
    """`value` with every `LazyOutput` in it (nested in tuples, lists, dicts) resolved."""
    return tree_map(lambda leaf: leaf.resolve() if isinstance(leaf, LazyOutput) else leaf, value)


def _forwarding(name: str):
    def method(self, *args):
        return getattr(self.resolve(), name)(*resolved(args))
    method.__name__ = name
    return method


# Python's operators on the output: the branch is waited for, then the tensor's own operator runs.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__", "__pos__", "__abs__", "__len__",
              "__iter__", "__bool__", "__float__", "__int__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
              "__ge__", "__array__", "__contains__"):
    setattr(LazyOutput, _name, _forwarding(_name))
LazyOutput.__hash__ = object.__hash__  # defining __eq__ would drop it; identity, as a tensor's

__all__ = ["LazyOutput", "resolved"]
