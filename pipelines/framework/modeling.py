"""ModelMixin: the base class of every model this library saves, loads and places."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
from accelerate import init_empty_weights
from torch import nn

from ..checkpoint import (
    DIFFUSERS_WEIGHTS_NAME,
    WeightsNaming,
    atomic_folder,
    find_weights,
    save_weights,
    validate_weights,
)
from ..checkpoint.config_file import CLASS_NAME_KEY, read_config, read_config_dict, write_config
from ..checkpoint.naming import CONFIG_NAME
from ..checkpoint.placing import cast_meta, load_and_dispatch
from .config import ModelConfig
from .hf_spellings import chosen_dtype, download_options
from .hub import hub_options, resolve_folder
from .model_memory import ModelMemoryMethods

logger = logging.getLogger(__name__)


class ModelMixin(ModelMemoryMethods, nn.Module):
    """An `nn.Module` built from a `ModelConfig`, saved and loaded in diffusers' folder format.

    Subclasses set `config_class` and take the config as the only constructor argument.
    `_no_split_modules` names the block classes a device map must never cut across devices;
    `_keep_in_fp32_modules` names submodules that stay in float32 whatever `torch_dtype` asks for;
    `_tied_weights_keys` maps each tied parameter to its source (`{"head.weight": "embed.weight"}`): the
    tied one is not saved, and is re-tied to its source after loading (ties made in `__init__` do not survive
    `init_empty_weights()`, which builds the model on meta).
    `enable_group_offload` / `enable_layerwise_casting` take diffusers' arguments (`model_memory`).
    """

    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    _no_split_modules: ClassVar[list[str] | None] = None
    _keep_in_fp32_modules: ClassVar[list[str] | None] = None
    _tied_weights_keys: ClassVar[dict[str, str] | None] = None
    weights_name: ClassVar[str] = DIFFUSERS_WEIGHTS_NAME

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

    def save_pretrained(
        self, save_directory: str | Path, *, max_shard_size: int | str | None = None, variant: str | None = None
    ) -> None:
        """Write config.json and the safetensors weights (sharded past `max_shard_size`, default 10GB).

        Atomic: everything is written to a temporary folder next to `save_directory` and renamed into place;
        if anything fails, an existing checkpoint there is untouched. Files of other variants are kept.
        """
        naming = WeightsNaming(weights_name=self.weights_name, variant=variant)
        tied = set(self._tied_weights_keys or ())
        state_dict = {name: t for name, t in self.state_dict().items() if name not in tied}
        with atomic_folder(save_directory, rewrites=lambda name: name == CONFIG_NAME or naming.owns(name)) as staging:
            write_config(staging, self.config, class_name=type(self).__name__)
            save_weights(
                state_dict, staging, weights_name=self.weights_name, variant=variant, max_shard_size=max_shard_size
            )

    @classmethod
    def from_pretrained(
        cls,
        pretrained: str | Path,
        *,
        torch_dtype: torch.dtype | None = None,
        device_map=None,
        max_memory: Mapping | None = None,
        offload_folder: str | Path | None = None,
        variant: str | None = None,
        subfolder: str | None = None,
        progress: bool = True,
        dtype: torch.dtype | None = None,
        use_safetensors: bool | None = None,
        local_files_only: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
    ):
        """Load a saved model: build it on meta, plan, stream every tensor to its device, dispatch.

        `pretrained`: a folder or a Hub id. `device_map`: None (everything on the CPU, no hooks), a single
        device ("cpu", "cuda", "cuda:1", 1, a torch.device), "auto" / "balanced" / "balanced_low_0" /
        "sequential", or a dict {submodule path: device}. `torch_dtype` None keeps the checkpoint's dtypes.
        Disk-offloaded weights are read from the checkpoint files themselves, so `offload_folder` only
        permits planning onto "disk". Every failure raises before a half-loaded model can escape. diffusers'
        spellings work too: `dtype=` for `torch_dtype=`; `use_safetensors`, `local_files_only`, `revision`,
        `token`, `cache_dir` for the Hub download (`hf_spellings`).
        """
        torch_dtype = chosen_dtype(torch_dtype, dtype)
        naming = WeightsNaming(weights_name=cls.weights_name, variant=variant)
        hub = download_options(use_safetensors=use_safetensors, revision=revision, token=token,
                               cache_dir=cache_dir, local_files_only=local_files_only)
        with hub_options(hub):
            folder = resolve_folder(pretrained, subfolder=subfolder, allow_patterns=naming.allow_patterns(subfolder))
        config = read_config(folder, cls.config_class)
        _warn_on_other_class(cls, folder)
        weights = find_weights(folder, weights_name=cls.weights_name, variant=variant)
        with init_empty_weights():
            model = cls(config)
        validate_weights(model, weights, tied_weights=cls._tied_weights_keys)
        keep = tuple(cls._keep_in_fp32_modules or ())
        cast_meta(model, weights, dtype=torch_dtype, keep_in_fp32=keep)
        resolved = _plan(model, device_map, max_memory=max_memory, offload_folder=offload_folder)
        load_and_dispatch(
            model, weights, resolved, dtype=torch_dtype, keep_in_fp32=keep,
            tied_weights=cls._tied_weights_keys, progress=progress,
        )
        return model.eval()


def _plan(model: nn.Module, device_map, *, max_memory, offload_folder) -> dict | None:
    """The model's flat device map from the model-level strategies (None when `device_map` is None)."""
    if device_map is None:
        return None
    from placement.model_map import model_device_map  # the sizing layer's model-level planner

    # disk_ok: a safetensors checkpoint serves disk-offloaded weights itself, no offload folder needed.
    return model_device_map(
        model, device_map, max_memory=max_memory, dtype=None, offload_folder=offload_folder, disk_ok=True
    )


def _warn_on_other_class(cls: type, folder: Path) -> None:
    saved = read_config_dict(folder).get(CLASS_NAME_KEY)
    if saved is not None and saved != cls.__name__:
        logger.warning("%s was saved by %s; loading it as %s.", folder / CONFIG_NAME, saved, cls.__name__)


__all__ = ["ModelMixin"]
