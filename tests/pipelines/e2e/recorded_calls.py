"""The tensor shapes a pipeline call really gives its denoiser, ControlNet and VAE (recorded from a run), and
those `call=` captures for the same call (`pipelines.loading.planning.describe_call`), in one format to compare:
{(component, method): sorted shapes of every tensor among the arguments}, first call of each method. Arguments
named like a mask are left out: a pipeline drops a mask whose tokens are all valid (Qwen-Image), which the
description keeps (it plans for the padded length)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from pipelines.loading.planning import describe_call, modules_and_edges

WATCHED = ("unet", "transformer", "transformer_2", "controlnet", "vae")
VAE_METHODS = ("encode", "decode")


def _shapes(args, kwargs) -> tuple:
    leaves, _ = tree_flatten_with_path((args, kwargs))
    return tuple(sorted(tuple(leaf.shape) for path, leaf in leaves
                        if isinstance(leaf, torch.Tensor) and "mask" not in keystr(path)))


def recorded_shapes(pipe, inputs: dict, runs: dict | None = None) -> tuple[dict, object]:
    """The shapes `pipe(**inputs)` gives each watched component, and the call's output; `runs`, if given, gets
    how many times each module component's forward ran ({component: count}, those that ran)."""
    found: dict = {}
    runs = {} if runs is None else runs

    def keep(key, args, kwargs):
        if key[0] in WATCHED:
            found.setdefault(key, _shapes(args, kwargs))
        if key[1] == "forward":
            runs[key[0]] = runs.get(key[0], 0) + 1

    modules, _ = modules_and_edges(pipe)
    with contextlib.ExitStack() as stack:
        for name, module in modules.items():
            for method in VAE_METHODS if name == "vae" else ():
                stack.enter_context(_recording_method(module, method, keep))
            handle = module.register_forward_pre_hook(
                lambda _, args, kwargs, key=(name, "forward"): keep(key, args, kwargs), with_kwargs=True)
            stack.callback(handle.remove)
        with torch.no_grad():
            output = pipe(**inputs)
    return found, output


@contextlib.contextmanager
def _recording_method(module, method, keep):
    original = getattr(module, method)

    def recorded(*args, **kwargs):
        keep(("vae", method), args, kwargs)
        return original(*args, **kwargs)

    setattr(module, method, recorded)
    try:
        yield
    finally:
        delattr(module, method)


def described_shapes(pipe, call: dict) -> dict:
    modules, _ = modules_and_edges(pipe)
    calls = describe_call(pipe, modules, call).calls
    described = {}
    for name in WATCHED:
        for example in calls.get(name, ()):
            described.setdefault((name, example.method), _shapes(example.args, dict(example.kwargs)))
    return described
