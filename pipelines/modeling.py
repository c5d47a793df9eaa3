"""ModelMixin: the base class of every model this library saves, loads and places."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from torch import nn

from .config import ModelConfig


class ModelMixin(nn.Module):
    """An `nn.Module` built from a `ModelConfig`.

    Subclasses set `config_class` and take the config as the only constructor argument.
    `_no_split_modules` names the block classes a device map must never cut across devices;
    `_keep_in_fp32_modules` names submodules that stay in float32 whatever `torch_dtype` asks for.
    """

    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    _no_split_modules: ClassVar[list[str] | None] = None
    _keep_in_fp32_modules: ClassVar[list[str] | None] = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}; "
                f"use {type(self).__name__}.from_config(...) to build one from a dict."
            )
        self._config = config
        self.hf_device_map: dict[str, Any] | None = None

    @property
    def config(self) -> ModelConfig:
        return self._config

    @classmethod
    def from_config(cls, config: ModelConfig | Mapping[str, Any], **overrides):
        """Build the model (random init) from a config object or a dict such as a parsed config.json."""
        if isinstance(config, ModelConfig):
            config = config.model_dump()
        fields = {k: v for k, v in dict(config).items() if not k.startswith("_")}
        fields.update(overrides)
        return cls(cls.config_class.model_validate(fields))
