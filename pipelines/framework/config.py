"""ModelConfig: the pydantic schema of a model's config.json."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ModelConfig(BaseModel):
    """Base class of every model config: frozen, and an unknown field is an error that names it.

    Subclass it and declare the architecture's hyper-parameters as typed fields with defaults.
    `config.json` stores these fields plus `_class_name` (the model class), as diffusers does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())
