"""What an estimate sets aside while the module's call runs on fake tensors, and puts back exactly on exit.

- accelerate's hooks: a dispatched module would move fake inputs to a real device; its original forwards run.
- the module's own state: lazily computed caches (Z-Image's `freqs_cis`) would keep fake tensors for the real run.
- torch's log lines and warnings: a failing meta kernel logs 30-odd lines before the exception reaches us, which
  becomes an `ActivationEstimateError` naming the component; the log would only bury it.
- the cyclic garbage collector: full collections over everything loaded cost 10% of a plan, and a tensor freed
  only by a collection would leave the live bytes whenever it happened to run; paused, estimates are deterministic.
"""

from __future__ import annotations

import functools
import gc
import logging
import types
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

_TORCH = "torch"


@contextmanager
def accelerate_hooks_bypassed(module: nn.Module) -> Iterator[None]:
    saved = []
    for submodule in module.modules():
        hook = submodule.__dict__.get("_hf_hook")
        if hook is None:
            continue
        saved.append((submodule, hook, submodule.__dict__.get("forward")))
        del submodule._hf_hook
        original = submodule.__dict__.get("_old_forward")
        if original is not None:
            submodule.forward = original
    try:
        yield
    finally:
        for submodule, hook, wrapper in saved:
            submodule._hf_hook = hook
            if wrapper is not None:
                submodule.forward = wrapper
            else:
                submodule.__dict__.pop("forward", None)


@contextmanager
def loggers_at_error(*names: str) -> Iterator[None]:
    """Within it, the loggers `names` say errors only; their own levels are put back on exit."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def torch_silenced() -> Iterator[None]:
    loggers = [logging.getLogger(_TORCH)] + [
        logger for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith(_TORCH + ".") and isinstance(logger, logging.Logger)
    ]
    was_disabled = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            yield
    finally:
        for logger, disabled in zip(loggers, was_disabled):
            logger.disabled = disabled


_MISSING = object()
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def _plain_object(value: object) -> bool:
    """An object holding state of its own (a helper class instance, callable or not: Z-Image's rotary embedder
    is called like a function), not a module, tensor, type, function or method."""
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, torch.Tensor, *_FUNCTIONS))


@contextmanager
def module_state_kept(module: nn.Module) -> Iterator[None]:
    """Within it `module` may change its attributes; on exit each one is as it was (see module doc)."""
    objects: list[tuple[dict, dict]] = []  # (an object's __dict__, its copy)
    containers: list[tuple[list | dict, list | dict]] = []

    def remember(state: dict, *, owner_is_module: bool) -> None:
        objects.append((state, dict(state)))
        for key, value in state.items():
            if owner_is_module and key in ("_parameters", "_buffers", "_modules"):
                continue  # torch's own registries: the estimate reparametrizes and restores them itself
            if isinstance(value, (list, dict)):  # dict subclasses too: torch's hook registries are OrderedDicts
                containers.append((value, list(value) if isinstance(value, list) else dict(value)))
            elif owner_is_module and _plain_object(value):
                remember(vars(value), owner_is_module=False)

    for submodule in module.modules():
        remember(vars(submodule), owner_is_module=True)
    try:
        yield
    finally:
        for container, saved in [*objects, *containers]:
            _put_back(container, saved)


def _put_back(container: list | dict, saved: list | dict) -> None:
    """`container` as `saved` holds it, through its own methods and only where it changed (a frozen config dict
    refuses writes; an ordered one keeps its order when only additions are removed)."""
    if isinstance(container, list):
        if len(container) != len(saved) or any(a is not b for a, b in zip(container, saved)):
            container[:] = saved
        return
    for key in [key for key in container if key not in saved]:
        del container[key]
    for key, value in saved.items():
        if container.get(key, _MISSING) is not value:
            container[key] = value


@contextmanager
def collection_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
