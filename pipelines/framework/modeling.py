"""ModelConfig (the pydantic schema of a model's config.json) and ModelMixin (the base class of every model this
library saves, loads and places), with diffusers' memory method names so code written for diffusers runs
unchanged."""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from torch import nn

from hooks import (
    GroupOffloadingConfig,
    LayerwiseCastingConfig,
    TECHNIQUES,
    Technique,
    group_offloading_fields,
    layerwise_casting_fields,
)
from hooks.gather import offloaded_weights
from placement.plan_schema import Plan

from ..checkpoint import WeightsNaming, atomic_folder, save_weights
from ..checkpoint.files import CONFIG_NAME, write_config
from ..folder.families import OwnModel
from ..loading.single_model import load_own_model, plan_own_model
from ..loading.request import (
    Entry,
    LoadOptions,
    LoadRequest,
    MODEL_LOAD,
    MODEL_PLAN,
    Scope,
    entry_signature,
    resolve_request,
)


class ModelConfig(BaseModel):
    """Base class of every model config: frozen, and an unknown field is an error that names it.

    Declare the architecture's hyper-parameters as typed fields with defaults; `config.json` stores them plus
    `_class_name`, as diffusers does. Integer and boolean fields are strict (a coerced `true` silently changes the
    architecture); other fields keep pydantic's JSON conversions."""

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


class ModelMixin(OwnModel):
    """An `nn.Module` built from a `ModelConfig`, saved and loaded in diffusers' folder format.

    Subclasses set `config_class` and take the config as the only constructor argument. `_no_split_modules`,
    `_keep_in_fp32_modules` and `_tied_weights_keys` (`{"head.weight": "embed.weight"}`: not saved, re-tied after
    loading, since ties made in `__init__` do not survive building on meta) are declared on
    `folder.sources.OwnModel`."""

    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    # diffusers' name for the patterns a model keeps in its own dtype when casting (None: the hooks' default).
    _skip_layerwise_casting_patterns: tuple[str, ...] | None = None

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
        """Write config.json and the safetensors weights (sharded past `max_shard_size`, default 10GB), atomically:
        an existing checkpoint is untouched on failure. Works in any placement, reading offloaded weights from where
        they live one shard at a time."""
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
        """The plan `from_pretrained` with the same keywords follows (default `device_map="auto"`): a one-component
        `placement.Plan` named after the class, from config.json and the safetensors headers only."""
        return plan_own_model(cls, _request(cls, pretrained, keywords, entry=MODEL_PLAN))

    @classmethod
    @entry_signature(MODEL_LOAD)
    def from_pretrained(cls, pretrained: str | Path, **keywords: Any):
        """Load a saved model (a folder or a Hub id): build on meta, plan, stream every tensor to its device, dispatch.

        `device_map`: None (the CPU, no hooks), one device (no hooks), accelerate's model-level strategies, or a dict
        {submodule path: device}; the plan is kept as `model.placement_plan`. Disk-offloaded weights are read from the
        checkpoint files themselves. Every failure raises before a half-loaded model can escape. diffusers' spellings
        and loading keywords are accepted or refused by name; any other keyword is an error naming the closest."""
        return load_own_model(cls, _request(cls, pretrained, keywords, entry=MODEL_LOAD))

    def enable_group_offload(
        self,
        onload_device: torch.device | int | str,
        offload_device: torch.device | str = "cpu",
        offload_type: str = "block_level",
        num_blocks_per_group: int | None = None,
        non_blocking: bool = False,
        use_stream: bool = False,
        record_stream: bool = False,
        low_cpu_mem_usage: bool = False,
        offload_to_disk_path: str | os.PathLike | None = None,
        block_modules=None,
        exclude_kwargs=None,
    ) -> None:
        """Group-offload this model: diffusers' signature, the group offloading row underneath."""
        fields = group_offloading_fields(None, dict(
            onload_device=onload_device, offload_device=offload_device, offload_type=offload_type,
            num_blocks_per_group=num_blocks_per_group, non_blocking=non_blocking, use_stream=use_stream,
            record_stream=record_stream, low_cpu_mem_usage=low_cpu_mem_usage,
            offload_to_disk_path=offload_to_disk_path, block_modules=block_modules, exclude_kwargs=exclude_kwargs,
        ))
        TECHNIQUES[Technique.GROUP_OFFLOAD].apply(self, GroupOffloadingConfig(**fields))

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Store Linear/Conv weights in `storage_dtype`, compute in `compute_dtype` (None: the model's current
        dtype, as diffusers does). `non_blocking` is accepted for diffusers' signature; casts are on-device."""
        if compute_dtype is None:
            compute_dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        if skip_modules_pattern is None:
            skip_modules_pattern = self._skip_layerwise_casting_patterns
        fields = layerwise_casting_fields(storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes,
                                          non_blocking)
        TECHNIQUES[Technique.LAYERWISE_CASTING].apply(self, LayerwiseCastingConfig(**fields))


def _request(cls: type, pretrained: str | Path, keywords: dict[str, Any], *, entry: Entry) -> LoadRequest:
    """The request both entries make from the same keywords; only the files fetched from the Hub differ (a plan
    reads config.json and the safetensors index)."""
    options, _ = LoadOptions.take(keywords, entry=entry, label=f"{cls.__name__}.{entry.method}")
    patterns = WeightsNaming(weights_name=cls.weights_name, variant=options.variant).allow_patterns(options.subfolder)
    if entry.plans:
        patterns = [pattern for pattern in patterns if pattern.endswith(".json")]
    return resolve_request(pretrained, options, scope=Scope.MODEL, allow_patterns=patterns)


__all__ = ["ModelMixin"]
