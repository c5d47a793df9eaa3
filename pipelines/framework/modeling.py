"""ModelMixin: the base class of every model this library saves, loads and places."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch

from hooks.gather import offloaded_weights
from placement.plan_schema import Plan

from ..checkpoint import WeightsNaming, atomic_folder, save_weights
from ..checkpoint.config_file import write_config
from ..checkpoint.naming import CONFIG_NAME
from ..folder.component_classes import OwnModel
from ..hf.hf_spellings import chosen_dtype, download_options
from ..loading.model_loader import load_model, plan_model
from ..loading.request import Scope, resolve_request
from .config import ModelConfig
from .model_memory import ModelMemoryMethods


class ModelMixin(ModelMemoryMethods, OwnModel):
    """An `nn.Module` built from a `ModelConfig`, saved and loaded in diffusers' folder format.

    Subclasses set `config_class` and take the config as the only constructor argument.
    `_no_split_modules` names the block classes a device map must never cut across devices;
    `_keep_in_fp32_modules` names submodules that stay in float32 whatever `torch_dtype` asks for;
    `_tied_weights_keys` maps each tied parameter to its source (`{"head.weight": "embed.weight"}`): the
    tied one is not saved, and is re-tied to its source after loading (ties made in `__init__` do not survive
    `init_empty_weights()`, which builds the model on meta).
    `enable_group_offload` / `enable_layerwise_casting` take diffusers' arguments (`model_memory`).
    These class attributes are declared (with `weights_name`) on `folder.component_classes.OwnModel`, the part of
    this class that the folder format and the loader read.
    """

    config_class: ClassVar[type[ModelConfig]] = ModelConfig

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}; "
                f"use {type(self).__name__}.from_config(...) to build one from a dict."
            )
        self._config = config
        self.hf_device_map: dict[str, Any] | None = None
        self.placement_plan: Plan | None = None  # the plan from_pretrained(device_map=...) followed

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
        Works in any placement (from_pretrained(device_map=...)): offloaded weights are read from where they
        live (CPU RAM, an offload store, the checkpoint files of "disk" parts) one shard at a time, and the
        placement stays as it is.
        """
        naming = WeightsNaming(weights_name=self.weights_name, variant=variant)
        tied = set(self._tied_weights_keys or ())
        state_dict = {name: t for name, t in self.state_dict().items() if name not in tied}
        offloaded = offloaded_weights(self)
        with atomic_folder(save_directory, rewrites=lambda name: name == CONFIG_NAME or naming.owns(name)) as staging:
            write_config(staging, self.config, class_name=type(self).__name__)
            save_weights(
                state_dict, staging, weights_name=self.weights_name, variant=variant, max_shard_size=max_shard_size,
                offloaded=offloaded)

    @classmethod
    def plan_placement(
        cls,
        pretrained: str | Path,
        *,
        device_map="auto",
        max_memory: Mapping | None = None,
        torch_dtype: torch.dtype | None = None,
        offload_folder: str | Path | None = None,
        variant: str | None = None,
        subfolder: str | None = None,
    ) -> Plan:
        """The plan `from_pretrained(..., device_map=...)` would follow: a one-component `placement.Plan`
        (component name: the class name), with `explain()` and fallback reasons. Builds the model on meta and
        reads config.json and the safetensors headers only (from the Hub: config and index only)."""
        naming = WeightsNaming(weights_name=cls.weights_name, variant=variant)
        request = resolve_request(
            pretrained, allow_patterns=[p for p in naming.allow_patterns(subfolder) if p.endswith(".json")],
            subfolder=subfolder, scope=Scope.MODEL, device_map=device_map, torch_dtype=torch_dtype,
            max_memory=max_memory, offload_folder=offload_folder, variant=variant)
        return plan_model(cls, request)

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
        device ("cpu", "cuda", "cuda:1", 1, a torch.device: everything there, no hooks), "auto" / "balanced" /
        "balanced_low_0" / "sequential" (accelerate's model-level meaning), or a dict {submodule path: device}.
        A device map is planned by `placement.plan` (see `plan_placement`; the plan is kept as
        `model.placement_plan`) and run by the same hooks as a pipeline component of that kind.
        `torch_dtype` None keeps the checkpoint's dtypes. Disk-offloaded weights are read from the checkpoint
        files themselves, so no offload folder is written. Every failure raises before a half-loaded model
        (or one with hooks) can escape.
        """
        # diffusers' spellings too: `dtype=` for `torch_dtype=`; use_safetensors, local_files_only, revision,
        # token, cache_dir for the Hub download (`hf_spellings`). A dtype or its name; else a typed error.
        hub = download_options(use_safetensors=use_safetensors, revision=revision, token=token,
                               cache_dir=cache_dir, local_files_only=local_files_only)
        naming = WeightsNaming(weights_name=cls.weights_name, variant=variant)
        request = resolve_request(
            pretrained, allow_patterns=naming.allow_patterns(subfolder), subfolder=subfolder, hub=hub,
            scope=Scope.MODEL, device_map=device_map, torch_dtype=chosen_dtype(torch_dtype, dtype),
            max_memory=max_memory, offload_folder=offload_folder, variant=variant, progress=progress)
        return load_model(cls, request)


__all__ = ["ModelMixin"]
