"""Folders and pipelines of the real diffusers families, at depth 1 and real widths, for call= tests.

The folders are `pipelines/presets/real_folders.py`'s (published configs, stand-in tokenizers and schedulers, no
weights); `meta_pipeline(key)` is the diffusers pipeline of one, its modules built on meta as planning builds them, and
`build_modules(key, device="cpu")` the same modules with random weights, for measuring real runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from accelerate import init_empty_weights

from pipelines.presets import real_folders

PIPELINES = real_folders.PIPELINES


def write_configs_folder(root: Path, key: str) -> Path:
    """A folder of family `key` at depth 1 to plan (configs, tokenizers, scheduler; no weights)."""
    return real_folders.write_folder(root, key, depth=1)


def build_modules(key: str, *, device: str = "meta") -> tuple[str, dict[str, torch.nn.Module]]:
    """The family's depth-1 modules, on meta or with real (random) weights in float32."""
    import diffusers
    import transformers

    pipeline_class, components = real_folders.module_specs(key, depth=1)
    modules = {}
    for name, (library, class_name, config) in components.items():
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
        torch.manual_seed(0)
        if device == "meta":
            with init_empty_weights():
                modules[name] = _build(cls, library, config)
        else:
            modules[name] = _as_measurable(_build(cls, library, config))
        modules[name].eval()
    return pipeline_class, modules


@functools.cache
def meta_pipeline(key: str):
    """The diffusers pipeline of family `key` at depth 1 as planning builds it: modules on meta, the folder's
    other parts (tokenizers, scheduler)."""
    return real_folders.meta_pipeline(key, depth=1)


def _as_measurable(module: torch.nn.Module) -> torch.nn.Module:
    """Parameters a model passes as an argument to a submodule (Sana's `scale_shift_table`) turned into buffers
    of the same bytes: MemTracker hooks the gradient of every argument that requires one, which fails under
    inference mode. Buffers and parameters are both left out of the activation peak, so nothing changes."""
    for name, parameter in list(module.named_parameters()):
        if name.endswith("scale_shift_table"):
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            delattr(owner, attribute)
            owner.register_buffer(attribute, parameter.detach())
    return module


def _build(cls, library: str, config: dict):
    if library == "diffusers":
        return cls.from_config(config)
    return cls._from_config(cls.config_class(**config))
