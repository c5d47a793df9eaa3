"""ModelConfig: the pydantic schema of a model's config.json.

ModelMixin: the base class of every model this library saves, loads and places.

Memory techniques on one model, under diffusers' `ModelMixin` method names, so code written for diffusers
(`transformer.enable_group_offload(...)`, `transformer.enable_layerwise_casting(...)`) runs unchanged.

Both apply a row of the technique table (`hooks.TECHNIQUES`, the same techniques the pipeline-level methods
use), with diffusers' arguments turned into its config by `hooks.group_offloading_fields` /
`hooks.layerwise_casting_fields`; see docs/memory.md for what each saves and costs."""

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
from ..folder.sources import OwnModel
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


class ModelMemoryMethods(nn.Module):
    """Mixed into `ModelMixin`."""

    # diffusers' name for the patterns a model keeps in its own dtype when casting (None: the hooks' default).
    _skip_layerwise_casting_patterns: tuple[str, ...] | None = None

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


class ModelMixin(ModelMemoryMethods, OwnModel):
    """An `nn.Module` built from a `ModelConfig`, saved and loaded in diffusers' folder format.

    Subclasses set `config_class` and take the config as the only constructor argument.
    `_no_split_modules` names the block classes a device map must never cut across devices;
    `_keep_in_fp32_modules` names submodules that stay in float32 whatever `torch_dtype` asks for;
    `_tied_weights_keys` maps each tied parameter to its source (`{"head.weight": "embed.weight"}`): the
    tied one is not saved, and is re-tied to its source after loading (ties made in `__init__` do not survive
    `init_empty_weights()`, which builds the model on meta).
    `enable_group_offload` / `enable_layerwise_casting` take diffusers' arguments (the memory methods below).
    These class attributes are declared (with `weights_name`) on `folder.sources.OwnModel`, the part of
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
        return plan_own_model(cls, _request(cls, pretrained, keywords, entry=MODEL_PLAN))

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
        return load_own_model(cls, _request(cls, pretrained, keywords, entry=MODEL_LOAD))


def _request(cls: type, pretrained: str | Path, keywords: dict[str, Any], *, entry: Entry) -> LoadRequest:
    """The request both entries make from the same keywords; only the files fetched from the Hub differ (a plan
    reads config.json and the safetensors index)."""
    options, _ = LoadOptions.take(keywords, entry=entry, label=f"{cls.__name__}.{entry.method}")
    patterns = WeightsNaming(weights_name=cls.weights_name, variant=options.variant).allow_patterns(options.subfolder)
    if entry.plans:
        patterns = [pattern for pattern in patterns if pattern.endswith(".json")]
    return resolve_request(pretrained, options, scope=Scope.MODEL, allow_patterns=patterns)


__all__ = ["ModelMixin"]
