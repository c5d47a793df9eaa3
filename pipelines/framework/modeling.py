"""ModelMixin: the base class of every model this library saves, loads and places."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch

from hooks.gather import offloaded_weights
from placement.plan_schema import Plan

from ..checkpoint import WeightsNaming, atomic_folder, save_weights
from ..checkpoint.files import CONFIG_NAME, write_config
from ..folder.sources import OwnModel
from ..loading.model_loader import load_model, plan_model
from ..loading.options import MODEL_LOAD, MODEL_PLAN, Entry, LoadOptions, Scope, entry_signature
from ..loading.request import LoadRequest, resolve_request
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
    @entry_signature(MODEL_PLAN)
    def plan_placement(cls, pretrained: str | Path, **keywords: Any) -> Plan:
        """The plan `from_pretrained` with the same keywords follows (the same `LoadOptions`, planned by the same
        function); without `device_map`, the plan of `device_map="auto"`: a one-component `placement.Plan`
        (component name: the class name), with `explain()` and fallback reasons. Builds the model on meta and
        reads config.json and the safetensors headers only (from the Hub: config and index only)."""
        return plan_model(cls, _request(cls, pretrained, keywords, entry=MODEL_PLAN))

    @classmethod
    @entry_signature(MODEL_LOAD)
    def from_pretrained(cls, pretrained: str | Path, **keywords: Any):
        """Load a saved model: build it on meta, plan, stream every tensor to its device, dispatch.

        `pretrained`: a folder or a Hub id. `device_map`: None (everything on the CPU, no hooks), a single
        device ("cpu", "cuda", "cuda:1", 1, a torch.device: everything there, no hooks), "auto" / "balanced" /
        "balanced_low_0" / "sequential" (accelerate's model-level meaning), or a dict {submodule path: device}.
        A device map is planned by `placement.plan` (see `plan_placement`; the plan is kept as
        `model.placement_plan`) and run by the same hooks as a pipeline component of that kind.
        `torch_dtype` None keeps the checkpoint's dtypes. Disk-offloaded weights are read from the checkpoint
        files themselves, so no offload folder is written. Every failure raises before a half-loaded model
        (or one with hooks) can escape. diffusers' spellings work too: `dtype=` for `torch_dtype=`;
        `use_safetensors`, `local_files_only`, `revision`, `token`, `cache_dir` for the Hub download. Its other
        loading keywords (`low_cpu_mem_usage`, ...) are accepted or refused by name (`hf.loading_keywords`); any
        other keyword is an error naming the closest argument.
        """
        return load_model(cls, _request(cls, pretrained, keywords, entry=MODEL_LOAD))


def _request(cls: type, pretrained: str | Path, keywords: dict[str, Any], *, entry: Entry) -> LoadRequest:
    """The request both entries make from the same keywords; only the files fetched from the Hub differ (a plan
    reads config.json and the safetensors index)."""
    options, _ = LoadOptions.take(keywords, entry=entry, label=f"{cls.__name__}.{entry.method}")
    patterns = WeightsNaming(weights_name=cls.weights_name, variant=options.variant).allow_patterns(options.subfolder)
    if entry.plans:
        patterns = [pattern for pattern in patterns if pattern.endswith(".json")]
    return resolve_request(pretrained, options, scope=Scope.MODEL, allow_patterns=patterns)


__all__ = ["ModelMixin"]
