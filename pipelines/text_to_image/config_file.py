"""The non-module components (tokenizer, scheduler): a frozen pydantic config saved as one JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ValidationError

from ..checkpoint.files import describe_validation_error, read_config, write_config
from ..errors import CallError


class ConfigFileComponent:
    """Built from `config_class(**fields)` or a config; `save_pretrained` writes `config_name`."""

    config_class: ClassVar[type[BaseModel]]
    config_name: ClassVar[str]

    def __init__(self, config: BaseModel | None = None, **fields):
        if config is not None and fields:
            raise CallError(f"Pass either a {self.config_class.__name__} or keyword fields, not both.")
        try:
            self._config = config or self.config_class(**fields)
        except ValidationError as error:
            raise CallError(f"{type(self).__name__}: {describe_validation_error(error)}.") from error

    @property
    def config(self):
        return self._config

    def save_pretrained(self, folder: str | Path) -> Path:
        return write_config(folder, self._config, class_name=type(self).__name__, file_name=self.config_name)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, subfolder: str | None = None):
        return cls(read_config(folder, cls.config_class, file_name=cls.config_name, subfolder=subfolder))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._config!r})"
