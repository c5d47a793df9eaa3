"""Which family a component class belongs to, and what that says about its folder.

Our own `ModelMixin`s (and users' subclasses), diffusers models and transformers models all keep a
`config.json` and safetensors weights in their subfolder, but they are built from their config differently and
name their weight files differently (`diffusion_pytorch_model*.safetensors` vs transformers' `model*.safetensors`).
Non-module components (tokenizers, schedulers) only need `from_pretrained(folder)`.

"Is this class ours?" is asked below the user base classes: `OwnModel` holds what the folder format and the
loader read of a `pipelines.ModelMixin` (which derives from it), so neither needs to import the framework.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

from pydantic import BaseModel
from torch import nn

from ..checkpoint import DIFFUSERS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME
from ..errors import FolderError


class OwnModel(nn.Module):
    """The contract of a model saved in this library's format, as the folder format and the loader read it.

    `config_class`: the pydantic class of its `config.json`; the constructor takes one instance of it.
    `weights_name`: the stem of its safetensors files. `_no_split_modules`: block class names a device map never
    cuts; `_keep_in_fp32_modules`: submodules kept float32 at any `torch_dtype`; `_tied_weights_keys`:
    `{tied parameter: source}`, the tied one not saved and re-tied after loading.
    """

    config_class: ClassVar[type[BaseModel]]
    weights_name: ClassVar[str] = DIFFUSERS_WEIGHTS_NAME
    _no_split_modules: ClassVar[list[str] | None] = None
    _keep_in_fp32_modules: ClassVar[list[str] | None] = None
    _tied_weights_keys: ClassVar[dict[str, str] | None] = None


class Family(str, Enum):
    """How a component class is built and saved."""

    OWN = "own"  # a pipelines.ModelMixin (ours or a user's)
    DIFFUSERS = "diffusers"
    TRANSFORMERS = "transformers"
    NON_MODULE = "non_module"  # tokenizer, scheduler, ...: from_pretrained(folder) only


def family_of(cls: type) -> Family:
    if isinstance(cls, type) and issubclass(cls, OwnModel):
        return Family.OWN
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return Family.NON_MODULE
    top_level = cls.__module__.split(".")[0]
    if top_level == "diffusers":
        return Family.DIFFUSERS
    if top_level == "transformers":
        return Family.TRANSFORMERS
    raise FolderError(
        f"{cls.__module__}.{cls.__name__} is an nn.Module but neither a pipelines.ModelMixin nor a diffusers or "
        "transformers model, so it cannot be built from a config.json; derive it from pipelines.ModelMixin."
    )


def weights_name_for(cls: type) -> str:
    """The weight-file stem of a module class: transformers' "model", diffusers' name, or our class's own."""
    family = family_of(cls)
    if family is Family.OWN:
        return cls.weights_name
    return TRANSFORMERS_WEIGHTS_NAME if family is Family.TRANSFORMERS else DIFFUSERS_WEIGHTS_NAME
