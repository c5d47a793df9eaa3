"""Call observers: forward pre-hooks that note only *that* a module was called, so an estimate may skip calls.

An estimate skips calls in two places: an identical block called again with inputs already seen is replayed
(`block_memo`), and a whole call estimated before is answered from the cache (`cache`). A hook that reads a
call's inputs or outputs cannot be told about a skipped call, so where a module carries one, nothing under it is
skipped (`only_observed`). A `CallObserver` (what `unit_order.record_module_order` registers) needs nothing but
the module: a skipped call is reported to it with `notify`, in the order the real run called the modules, so the
order a split is cut in is the same with or without skipping.

`CallLog` is the observer an estimate puts on every submodule while it runs: the sequence of calls it sees is
what a replay or a cache hit reports later.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterable, Iterator

from torch import nn
from torch.nn.modules import module as torch_module


class CallObserver:
    """A forward pre-hook (`module.register_forward_pre_hook(observer)`) that only notes which module ran."""

    def __call__(self, module: nn.Module, args) -> None:
        self.called(module)

    def called(self, module: nn.Module) -> None:
        raise NotImplementedError


def notify(module: nn.Module) -> None:
    """Tell `module`'s observers it was called (a call that was skipped: replayed or answered from the cache)."""
    for hook in list(module._forward_pre_hooks.values()):
        if isinstance(hook, CallObserver):
            hook.called(module)


def only_observed(modules: Iterable[nn.Module]) -> bool:
    """Whether a call of these modules may be skipped: no hook that sees inputs or outputs (theirs or global),
    and no `forward` replaced by someone else's wrapper (a diffusers hook, a patch) that might keep state."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    for module in modules:
        if module._forward_hooks or not all(isinstance(hook, CallObserver)
                                            for hook in module._forward_pre_hooks.values()):
            return False
        if not _own_forward(module):
            return False
    return True


def _own_forward(module: nn.Module) -> bool:
    # An instance `forward` is fine when it is the class's own bound to the module (what bypassing accelerate's
    # hooks puts back); anything else wraps the call in code we cannot replay.
    forward = module.__dict__.get("forward")
    return forward is None or (inspect.ismethod(forward) and forward.__self__ is module
                               and forward.__func__ is getattr(type(module), "forward", None))


@contextlib.contextmanager
def observers_deferred(root: nn.Module) -> Iterator[None]:
    """Within it, the `CallObserver`s on `root`'s submodules are set aside (other hooks stay, in their order); the
    caller tells them the calls afterwards (`notify_paths`). An estimate that abandons a run for another
    (`block_memo`'s `ReplayDiverged`) thus reports one run's calls, as a cache hit does."""
    saved = []
    for module in root.modules():
        hooks = module._forward_pre_hooks
        if any(isinstance(hook, CallObserver) for hook in hooks.values()):
            saved.append((module, dict(hooks)))
            for key in [key for key, hook in hooks.items() if isinstance(hook, CallObserver)]:
                del hooks[key]
    try:
        yield
    finally:
        for module, hooks in saved:
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks.update(hooks)


class CallLog(CallObserver):
    """The modules called, in order, every call (replayed ones too: `notify` reaches this observer as well)."""

    def __init__(self) -> None:
        self.calls: list[nn.Module] = []

    def called(self, module: nn.Module) -> None:
        self.calls.append(module)

    @contextlib.contextmanager
    def on(self, root: nn.Module) -> Iterator["CallLog"]:
        handles = [sub.register_forward_pre_hook(self) for sub in root.modules()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def paths(self, root: nn.Module, start: int = 0, end: int | None = None) -> tuple[str, ...]:
        """The calls from `start` to `end` as paths under `root` (a module outside it is left out)."""
        names = {id(sub): path for path, sub in root.named_modules()}
        return tuple(names[id(sub)] for sub in self.calls[start:end] if id(sub) in names)


def notify_paths(root: nn.Module, paths: Iterable[str]) -> None:
    """`notify` each of `root`'s submodules named by `paths`, in that order (a skipped call's recorded calls)."""
    modules = dict(root.named_modules())
    for path in paths:
        notify(modules[path])
