"""What differs between the three families of components a pipeline folder can hold.

Our own `ModelMixin`s (and users' subclasses), diffusers models and transformers models all keep a
`config.json` and safetensors weights in their subfolder, but they are built from their config differently and
name their weight files differently (`diffusion_pytorch_model*.safetensors` vs transformers' `model*.safetensors`).
This module knows those differences, so that planning and streaming treat every module the same way.
Non-module components (tokenizers, schedulers) only need `from_pretrained(folder)`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Iterable

import torch
from accelerate import init_empty_weights
from torch import nn

from placement.errors import PlacementError
from placement.sizing import kept_fp32_module_names

from ..checkpoint import DIFFUSERS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME, tie_weights
from ..checkpoint.config_file import read_config
from .modeling import ModelMixin


class ComponentBuildError(PlacementError, ValueError):
    """A component class that cannot be built from its folder's config."""


class Family(str, Enum):
    """How a component class is built and saved."""

    OWN = "own"  # a pipelines.ModelMixin (ours or a user's)
    DIFFUSERS = "diffusers"
    TRANSFORMERS = "transformers"
    NON_MODULE = "non_module"  # tokenizer, scheduler, ...: from_pretrained(folder) only


def family_of(cls: type) -> Family:
    if isinstance(cls, type) and issubclass(cls, ModelMixin):
        return Family.OWN
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return Family.NON_MODULE
    top_level = cls.__module__.split(".")[0]
    if top_level == "diffusers":
        return Family.DIFFUSERS
    if top_level == "transformers":
        return Family.TRANSFORMERS
    raise ComponentBuildError(
        f"{cls.__module__}.{cls.__name__} is an nn.Module but neither a pipelines.ModelMixin nor a diffusers or "
        "transformers model, so it cannot be built from a config.json; derive it from pipelines.ModelMixin."
    )


def weights_name_for(cls: type) -> str:
    """The weight-file stem of a module class: transformers' "model", diffusers' name, or our class's own."""
    family = family_of(cls)
    if family is Family.OWN:
        return cls.weights_name
    return TRANSFORMERS_WEIGHTS_NAME if family is Family.TRANSFORMERS else DIFFUSERS_WEIGHTS_NAME


def tied_weights_for(module: nn.Module, saved: Iterable[str]) -> dict[str, str]:
    """{tied name: source name} for every parameter shared under several names (after `build_on_meta` tied
    them) whose checkpoint stores only one of the names, e.g. transformers' T5 `encoder.embed_tokens.weight`
    -> `shared.weight`. Found from the module itself, so it holds for every family."""
    saved = set(saved)
    names_of: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    ties = {}
    for names in names_of.values():
        sources = [name for name in names if name in saved]
        ties.update({name: sources[0] for name in names if sources and name not in saved})
    return ties


def build_on_meta(cls: type, folder: Path) -> nn.Module:
    """Build `cls` from `folder/config.json` with every weight on the meta device (no memory, no init cost).

    Weight tying is redone after leaving `init_empty_weights()`: accelerate's context breaks ties made inside it.
    """
    family = family_of(cls)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ComponentBuildError(f"{config_path} not found: component folder {folder.name!r} needs its config.json.")
    with init_empty_weights():
        if family is Family.OWN:
            module = cls(read_config(folder, cls.config_class))
        elif family is Family.DIFFUSERS:
            module = cls.from_config(cls.load_config(folder))
        else:
            module = cls._from_config(cls.config_class.from_pretrained(folder))
    if family is Family.OWN:
        tie_weights(module, cls._tied_weights_keys)
    elif callable(getattr(module, "tie_weights", None)):
        module.tie_weights()
    return module.eval()


def load_without_device_map(cls: type, folder: Path, *, dtype: torch.dtype | None, variant: str | None) -> Any:
    """A component loaded by its own class to the CPU (the no-device_map path)."""
    family = family_of(cls)
    if family is Family.NON_MODULE:
        return cls.from_pretrained(folder)
    if family is Family.TRANSFORMERS:
        return cls.from_pretrained(folder, dtype=dtype, variant=variant).eval()
    # Ours and diffusers' take the same arguments.
    return cls.from_pretrained(folder, torch_dtype=dtype, variant=variant).eval()


def keep_in_fp32_modules(module: nn.Module, dtype: torch.dtype | None) -> tuple[str, ...]:
    """The submodule names loading at `dtype` keeps in float32: the very rule sizing uses
    (`placement.sizing.kept_fp32_module_names`: diffusers and ours at any dtype, transformers only at fp16 plus
    its strict list), so a plan never assumes bf16 for weights the loader then reads as fp32."""
    return tuple(sorted(kept_fp32_module_names(module, dtype)))


def known_execution_order(class_name: str) -> list[str] | None:
    """The execution order of a known diffusers pipeline class (`model_cpu_offload_seq`), if importable."""
    try:
        import diffusers
    except ImportError:
        return None
    pipeline_class = getattr(diffusers, class_name, None)
    sequence = getattr(pipeline_class, "model_cpu_offload_seq", None)
    return sequence.split("->") if isinstance(sequence, str) else None
