"""Estimate a module that already carries accelerate hooks (dispatched, offloaded, pinned by the caller).

accelerate's hooks replace `module.forward` with a wrapper that moves inputs to an execution device and
loads offloaded weights; on fake tensors that would mean moving them to a real device. What the estimate
needs is the module's own computation, so for the length of the call every hooked submodule runs its
original forward (`_old_forward`, kept by `add_hook_to_module`) and has no `_hf_hook` (entry points such as
a VAE's `decode` check it); on exit every hook and wrapper is put back exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


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
