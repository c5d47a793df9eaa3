"""ModelConfig: the pydantic schema of a model's config.json."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class ModelConfig(BaseModel):
    """Base class of every model config: frozen, and an unknown field is an error that names it.

    Subclass it and declare the architecture's hyper-parameters as typed fields with defaults.
    `config.json` stores these fields plus `_class_name` (the model class), as diffusers does.
    Integer and boolean fields are strict: `true` for an int, `2.0` for an int or `1` for a bool is an error
    naming the field, never coerced (a coerced `true` silently changes the architecture). Other fields keep
    pydantic's JSON conversions (a list for a tuple, an int for a float).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_or_float_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        accepted = _scalar_types(field.annotation)
        if int in accepted and bool not in accepted and isinstance(value, (bool, float)):
            raise ValueError(f"expects an integer, got {value!r} ({type(value).__name__}); write it as an integer")
        if bool in accepted and int not in accepted and isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"expects true or false, got {value!r}")
        return value


def _scalar_types(annotation: Any) -> set[type]:
    """{int} for `int`, {int, NoneType} for `int | None`, ...; empty for containers and other types."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {arg for arg in typing.get_args(annotation) if isinstance(arg, type)}
    return {annotation} if isinstance(annotation, type) else set()
