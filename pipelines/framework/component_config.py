"""Save and load the JSON config of a non-module component (scheduler, tokenizer), diffusers-style.

The file holds the pydantic config's fields plus `_class_name`; keys starting with "_" are bookkeeping and
ignored on load. Every failure names the file and says what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from placement.errors import PlacementError

CLASS_NAME_KEY = "_class_name"
Config = TypeVar("Config", bound=BaseModel)


class ComponentConfigError(PlacementError, ValueError):
    """A missing, unreadable or invalid component config file (scheduler_config.json, tokenizer_config.json)."""


def write_component_config(folder: str | Path, file_name: str, config: BaseModel, *, class_name: str) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name
    content = {CLASS_NAME_KEY: class_name, **config.model_dump(mode="json")}
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_component_config(
    folder: str | Path, file_name: str, config_class: type[Config], *, subfolder: str | None = None
) -> Config:
    folder = Path(folder) / subfolder if subfolder else Path(folder)
    path = folder / file_name
    if not path.is_file():
        raise ComponentConfigError(
            f"No {file_name} in {str(folder)!r}; save the component there with save_pretrained(folder) first."
        )
    try:
        content: Any = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ComponentConfigError(f"{str(path)!r} is not valid JSON ({error}).") from error
    if not isinstance(content, dict):
        raise ComponentConfigError(f"{str(path)!r} must hold a JSON object, got {type(content).__name__}.")
    fields = {key: value for key, value in content.items() if not key.startswith("_")}
    try:
        return config_class.model_validate(fields)
    except ValidationError as error:
        raise ComponentConfigError(
            f"{str(path)!r} does not validate as {config_class.__name__}: {describe_validation_error(error)}."
        ) from error


def describe_validation_error(error: ValidationError) -> str:
    """"field 'shift': Input should be greater than 0 (got -1)" for each problem, joined by "; "."""
    problems = []
    for problem in error.errors():
        field = ".".join(str(part) for part in problem.get("loc", ())) or "<root>"
        if problem.get("type") == "extra_forbidden":
            problems.append(f"unknown field {field!r}")
        else:
            problems.append(f"field {field!r}: {problem.get('msg')} (got {problem.get('input')!r})")
    return "; ".join(problems)
