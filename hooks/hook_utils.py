"""Helpers over accelerate's one `_hf_hook` per module (chained by `SequentialHook`): every technique installs
accelerate hooks, so `remove_hook_from_module(recurse=True)` undoes all; these find and remove one's own."""

from __future__ import annotations

from collections.abc import Iterator

from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module
from torch import nn


def hooks_of(module: nn.Module) -> list[ModelHook]:
    """The hooks installed on `module` itself, with `SequentialHook` chains flattened."""
    hook = getattr(module, "_hf_hook", None)
    return _flatten(hook) if hook is not None else []


def _flatten(hook: ModelHook) -> list[ModelHook]:
    if isinstance(hook, SequentialHook):
        return [inner for part in hook.hooks for inner in _flatten(part)]
    return [hook]


def find_hooks(root: nn.Module, hook_types: type | tuple[type, ...]) -> Iterator[tuple[str, nn.Module, ModelHook]]:
    """(qualified module name, module, hook) for every hook of `hook_types` in `root`'s tree."""
    for name, module in root.named_modules():
        for hook in hooks_of(module):
            if isinstance(hook, hook_types):
                yield name, module, hook


def has_hook(root: nn.Module, hook_types: type | tuple[type, ...]) -> bool:
    return next(find_hooks(root, hook_types), None) is not None


def remove_hooks_of_type(root: nn.Module, hook_types: type | tuple[type, ...]) -> int:
    """Detach every hook of `hook_types` in `root`'s tree (root first), keeping the others chained; how many."""
    return sum(remove_hooks_where(module, lambda hook: isinstance(hook, hook_types)) for module in list(root.modules()))


def remove_hooks_where(module: nn.Module, predicate) -> int:
    """Detach the hooks of `module` itself for which `predicate(hook)` holds, keeping the others chained."""
    hooks = hooks_of(module)
    kept = [hook for hook in hooks if not predicate(hook)]
    for hook in hooks:
        if predicate(hook):
            hook.detach_hook(module)
    if len(kept) != len(hooks):
        _reinstall(module, kept)
    return len(hooks) - len(kept)


def runs_forward(module: nn.Module) -> bool:
    """The module computes in its own forward, so a hook on it fires; containers (ModuleDict, ParameterDict:
    peft keeps some adapter tensors in them) never run."""
    return type(module).forward is not nn.Module.forward


def running_ancestor(root: nn.Module, module: nn.Module) -> nn.Module:
    """`module` if it runs its own forward, else its nearest ancestor under `root` that does (where a hook
    fires while `module`'s tensors are used)."""
    parents = {id(child): parent for parent in root.modules() for child in parent.children()}
    while not runs_forward(module) and id(module) in parents:
        module = parents[id(module)]
    return module


def add_hook_first(module: nn.Module, hook: ModelHook) -> None:
    """Install `hook` before the hooks already on `module` (whose state is kept)."""
    hook.init_hook(module)
    _reinstall(module, [hook, *hooks_of(module)])


def add_hook_last(module: nn.Module, hook: ModelHook) -> None:
    """Install `hook` after the hooks already on `module`, without detaching them (as accelerate's append does:
    a layerwise-casting hook would cast its weights back, a group offloading hook would restore them)."""
    hook.init_hook(module)
    _reinstall(module, [*hooks_of(module), hook])


def _reinstall(module: nn.Module, hooks: list[ModelHook]) -> None:
    """Chain already-initialised `hooks` on `module`, with `init_hook` silenced: accelerate would re-run it on
    every hook of the chain (`CpuOffload` would move the module to the CPU again)."""
    _unwrap_forward(module)
    if not hooks:
        return
    chain = hooks[0] if len(hooks) == 1 else SequentialHook(*hooks)
    chain.init_hook = _already_initialised  # instance attribute shadows the method for this one call
    try:
        add_hook_to_module(module, chain)
    finally:
        del chain.init_hook


def _already_initialised(module: nn.Module) -> nn.Module:
    return module


def _unwrap_forward(module: nn.Module) -> None:
    """`remove_hook_from_module` without calling `detach_hook` (the caller detached what it meant to)."""
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is None:
        return
    module._hf_hook = ModelHook()  # a base hook's detach_hook does nothing
    remove_hook_from_module(module)
