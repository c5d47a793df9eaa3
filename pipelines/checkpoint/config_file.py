"""config.json: a model's `ModelConfig` fields plus `_class_name`, as diffusers writes it.

Keys starting with "_" (`_class_name`, `_diffusers_version`, ...) are bookkeeping, not config fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import CorruptCheckpointError, InvalidConfigError, WeightsNotFoundError
from .naming import CONFIG_NAME

CLASS_NAME_KEY = "_class_name"


def write_config(folder: str | Path, config: BaseModel, *, class_name: str) -> Path:
    path = Path(folder) / CONFIG_NAME
    content = {CLASS_NAME_KEY: class_name, **config.model_dump(mode="json")}
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_config_dict(folder: str | Path) -> dict[str, Any]:
    """The raw config.json of `folder` (errors name the file)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise WeightsNotFoundError(f"No {CONFIG_NAME} in {str(Path(folder))!r}: this is not a saved model folder.")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(f"{str(path)!r} is not valid JSON ({error}).") from error
    if not isinstance(content, dict):
        raise CorruptCheckpointError(f"{str(path)!r} must hold a JSON object, got {type(content).__name__}.")
    return content


def read_config(folder: str | Path, config_class: type[BaseModel]) -> BaseModel:
    """Validate config.json against `config_class`; an unknown, missing or ill-typed field is named."""
    content = read_config_dict(folder)
    fields = {key: value for key, value in content.items() if not key.startswith("_")}
    try:
        return config_class.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(_describe(problem) for problem in error.errors())
        raise InvalidConfigError(
            f"{str(Path(folder) / CONFIG_NAME)!r} does not validate as {config_class.__name__}: {problems}. "
            "Fix or remove these fields."
        ) from error


def _describe(problem: dict) -> str:
    field = ".".join(str(part) for part in problem.get("loc", ())) or "<root>"
    if problem.get("type") == "extra_forbidden":
        return f"unknown field {field!r}"
    return f"field {field!r}: {problem.get('msg')} (got {problem.get('input')!r})"
