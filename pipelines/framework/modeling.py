"""ModelMixin: the base class of every model this library saves, loads and places."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
from accelerate import init_empty_weights
from torch import nn

import placement
from placement.device_maps import is_single_device
from placement.plan_schema import Plan
from placement.sizing import dtype_for, kept_fp32_module_names

from ..checkpoint import (
    DIFFUSERS_WEIGHTS_NAME,
    WeightsIndex,
    WeightsNaming,
    WeightsNotFoundError,
    atomic_folder,
    check_accelerators_exist,
    find_weights,
    load_weights,
    save_weights,
    tie_weights,
    validate_weights,
)
from ..checkpoint.config_file import CLASS_NAME_KEY, read_config, read_config_dict, write_config
from ..checkpoint.naming import CONFIG_NAME
from ..checkpoint.placing import cast_meta, load_component
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
        patterns = [p for p in naming.allow_patterns(subfolder) if p.endswith(".json")]
        folder = resolve_folder(pretrained, subfolder=subfolder, allow_patterns=patterns)
        model, weights = _build_sized_on_meta(cls, folder, torch_dtype=torch_dtype, variant=variant,
                                              weights_required=False)
        return _plan(model, weights, device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                     offload_folder=offload_folder)

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
        torch_dtype = dtype_for(chosen_dtype(torch_dtype, dtype), "default")
        naming = WeightsNaming(weights_name=cls.weights_name, variant=variant)
        hub = download_options(use_safetensors=use_safetensors, revision=revision, token=token,
                               cache_dir=cache_dir, local_files_only=local_files_only)
        with hub_options(hub):
            folder = resolve_folder(pretrained, subfolder=subfolder, allow_patterns=naming.allow_patterns(subfolder))
        model, weights = _build_sized_on_meta(cls, folder, torch_dtype=torch_dtype, variant=variant,
                                              weights_required=True)
        keep = _kept_fp32(model, torch_dtype)
        if device_map is None:
            load_weights(model, weights, dtype=torch_dtype, keep_in_fp32=keep, tied_weights=cls._tied_weights_keys,
                         progress=progress)
            return model.eval()
        plan = _plan(model, weights, device_map, max_memory=max_memory, torch_dtype=torch_dtype,
                     offload_folder=offload_folder)
        component = plan.components[_component_name(model)]
        check_accelerators_exist(type(model).__name__, [*component.devices, component.execution_device])
        load_component(
            model, weights, component, hooks=not is_single_device(device_map), dtype=torch_dtype,
            keep_in_fp32=keep, tied_weights=cls._tied_weights_keys, progress=progress,
        )
        model.placement_plan = plan
        return model.eval()


def _build_sized_on_meta(cls: type, folder: Path, *, torch_dtype, variant, weights_required: bool):
    """The model on meta, each tensor in the dtype it will load as, and its checkpoint index (None when the
    folder has no weights and they are not required: planning then sizes from the config's dtypes)."""
    config = read_config(folder, cls.config_class)
    _warn_on_other_class(cls, folder)
    with init_empty_weights():
        model = cls(config)
    try:
        weights = find_weights(folder, weights_name=cls.weights_name, variant=variant)
    except WeightsNotFoundError:
        if weights_required:
            raise
        weights = None
    if weights is not None:
        validate_weights(model, weights, tied_weights=cls._tied_weights_keys)
        cast_meta(model, weights, dtype=torch_dtype, keep_in_fp32=_kept_fp32(model, torch_dtype))
    # Ties made in __init__ do not survive init_empty_weights() or the re-typing above; re-tie so the plan
    # counts a tied weight once, as the loaded model holds it.
    tie_weights(model, cls._tied_weights_keys)
    return model, weights


def _kept_fp32(model: nn.Module, torch_dtype) -> tuple[str, ...]:
    """The modules that stay float32 at `torch_dtype`: sizing's own rule (`kept_fp32_module_names`), so the
    plan's bytes and the loaded bytes agree (none without a torch_dtype: tensors load as saved)."""
    return tuple(sorted(kept_fp32_module_names(model, dtype_for(torch_dtype, ""))))


def _plan(model: nn.Module, weights: WeightsIndex | None, device_map, *, max_memory, torch_dtype,
          offload_folder) -> Plan:
    """`placement.plan` for one model at model scope (accelerate's meaning of the strategy names)."""
    # As for a pipeline (and accelerate), `offload_folder` is what permits planning onto "disk"; nothing is
    # written there: the checkpoint's own safetensors files serve the disk-offloaded weights.
    return placement.plan({_component_name(model): model}, max_memory=max_memory, strategy=device_map,
                          dtype=torch_dtype, offload_folder=offload_folder, scope="model")


def _component_name(model: nn.Module) -> str:
    return type(model).__name__


def _warn_on_other_class(cls: type, folder: Path) -> None:
    saved = read_config_dict(folder).get(CLASS_NAME_KEY)
    if saved is not None and saved != cls.__name__:
        logger.warning("%s was saved by %s; loading it as %s.", folder / CONFIG_NAME, saved, cls.__name__)


__all__ = ["ModelMixin"]
