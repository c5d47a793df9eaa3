"""Loading a component through the library that owns its format (quantized folders, transformers checkpoints whose
keys are renamed on load, single files), given our plan's map and dtype (`OwnerLoad`). `renames_explain` tells whether transformers' own conversion
explains a checkpoint's other key names, so a checkpoint that is simply wrong still fails with the keys named. How
each family builds, ties and reads its models is the family's own (pipelines/folder/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..errors import PipelineLoadError
from ..folder.families import ModelFamily
from .quantizers import ComponentQuantization, QuantizationMethod


@dataclass(frozen=True, kw_only=True)
class OwnerLoad:
    """One call of the owner's loader: `source` is the component folder, or the checkpoint file when
    `single_file_config` (the folder holding the model's config.json, read offline) is given."""

    cls: type
    family: ModelFamily
    source: Path
    dtype: torch.dtype | None
    quantization: ComponentQuantization | None = None
    variant: str | None = None
    single_file_config: Path | None = None

    @property
    def single_file(self) -> bool:
        return self.single_file_config is not None

    @property
    def takes_multi_device_maps(self) -> bool:
        """diffusers' single-file loader takes one device only, and its quanto quantizer refuses multi-entry maps."""
        if self.single_file:
            return False
        quanto = self.quantization is not None and self.quantization.method is QuantizationMethod.QUANTO
        return self.family.takes_multi_device_maps(quanto)


def load_with_owner(owner: OwnerLoad, device_map: Mapping[str, Any], *, name: str) -> nn.Module:
    """The component loaded by its owner onto `device_map` (module paths -> torch devices / "cpu"), in eval mode."""
    try:
        module = _single_file(owner, device_map) if owner.single_file else _from_pretrained(owner, device_map)
    except (OSError, ValueError, RuntimeError, ImportError, TypeError, KeyError) as error:
        raise PipelineLoadError(
            f"Component {name!r}: {owner.cls.__name__} could not be loaded by {owner.family.name} from "
            f"{str(owner.source)!r}: {type(error).__name__}: {error}"
        ) from error
    return module.eval()


def _from_pretrained(owner: OwnerLoad, device_map: Mapping[str, Any]) -> nn.Module:
    arguments: dict[str, Any] = {"device_map": dict(device_map), "variant": owner.variant}
    if owner.quantization is not None and not owner.quantization.pre_quantized:
        arguments["quantization_config"] = owner.quantization.config
    return owner.family.from_pretrained(owner.cls, owner.source, dtype=owner.dtype, **arguments)


def _single_file(owner: OwnerLoad, device_map: Mapping[str, Any]) -> nn.Module:
    """diffusers' `from_single_file`, its config from a local folder (no Hub), onto the one device it takes."""
    devices = set(device_map.values())
    arguments: dict[str, Any] = {"config": str(owner.single_file_config), "local_files_only": True,
                                 "torch_dtype": owner.dtype}
    if len(devices) == 1 and str(next(iter(devices))) != "cpu":
        arguments["device"] = next(iter(devices))
    if owner.quantization is not None:
        arguments["quantization_config"] = owner.quantization.config
    return owner.cls.from_single_file(str(owner.source), **arguments)


def remove_owner_state(module: nn.Module) -> None:
    """What the owner's load leaves that our placement replaces: its device map (ours is set by the runtime)."""
    if "hf_device_map" in vars(module):
        del module.hf_device_map


def renames_explain(module: nn.Module, checkpoint_keys: Iterable[str], *, allowed_missing: Iterable[str] = ()) -> bool:
    """Whether transformers' conversion mapping of `module`'s class turns `checkpoint_keys` into every tensor the
    module needs (`allowed_missing`: tied weights); False when nothing is converted."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return False
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = module.state_dict(keep_vars=True)
    prefix = getattr(module, "base_model_prefix", None) or None
    keys = list(checkpoint_keys)
    renamed = {rename_source_key(key, renamings, converters, prefix, expected)[0] for key in keys}
    if renamed == set(keys):
        return False
    missing = set(expected) - renamed - set(allowed_missing)
    return not missing


__all__ = ["OwnerLoad", "load_with_owner", "remove_owner_state", "renames_explain"]


def load_without_device_map(cls: type, folder: Path, *, family: ModelFamily, dtype: torch.dtype | None,
                            variant: str | None, quantization_config: Any = None) -> Any:
    """A component loaded by its own class to the CPU, a quantized one by its owner's quantizer."""
    if not family.is_module:
        return family.from_pretrained(cls, folder, dtype=dtype)
    extra = {} if quantization_config is None else {"quantization_config": quantization_config}
    return family.from_pretrained(cls, folder, dtype=dtype, variant=variant, **extra).eval()
