"""Make a model's extra entry points (a VAE's `encode`/`decode`) go through its accelerate hook.

accelerate installs its hooks by replacing `module.forward`; a pipeline that calls `vae.decode(...)` would
bypass them, so an offloaded or dispatched VAE would run with its weights elsewhere and its inputs on the
wrong device. diffusers solves this with `apply_forward_hook` (pre-forward only); we run the whole hook:
the inputs move to the execution device, the weights are loaded, and the output comes back as from forward.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

Method = TypeVar("Method", bound=Callable)


def hooked_entry_point(method: Method) -> Method:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        hook = getattr(self, "_hf_hook", None)
        if hook is None:
            return method(self, *args, **kwargs)
        args, kwargs = hook.pre_forward(self, *args, **kwargs)
        return hook.post_forward(self, method(self, *args, **kwargs))

    return wrapper  # type: ignore[return-value]
