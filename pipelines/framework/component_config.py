"""The config files of non-module components (scheduler, tokenizer): the same writer and reader as a model's
config.json (`checkpoint.config_file`), kept under their earlier names for the components that use them."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ..checkpoint.config_file import Config, describe_validation_error, read_config, write_config
from ..checkpoint.errors import CheckpointError

ComponentConfigError = CheckpointError  # missing (WeightsNotFoundError), unreadable or invalid config file


def write_component_config(folder: str | Path, file_name: str, config: BaseModel, *, class_name: str) -> Path:
    return write_config(folder, config, class_name=class_name, file_name=file_name)


def read_component_config(
    folder: str | Path, file_name: str, config_class: type[Config], *, subfolder: str | None = None
) -> Config:
    return read_config(folder, config_class, file_name=file_name, subfolder=subfolder)


__all__ = ["ComponentConfigError", "describe_validation_error", "read_component_config", "write_component_config"]
