"""Loading a component through the library that owns its format (quantized folders, transformers checkpoints whose
keys are renamed on load, single files), given our plan's map and dtype (`OwnerLoad`); how each family builds a
module from its config (`construct`, `retie`). `renames_explain` tells whether transformers' own conversion
explains a checkpoint's other key names, so a checkpoint that is simply wrong still fails with the keys named."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..checkpoint import tie_weights
from ..checkpoint.files import CONFIG_NAME, read_config
from ..errors import PipelineLoadError, WeightsNotFoundError
from ..folder.sources import Family
from .quantizers import ComponentQuantization, QuantizationMethod


@dataclass(frozen=True, kw_only=True)
class OwnerLoad:
    """One call of the owner's loader: `source` is the component folder, or the checkpoint file when
    `single_file_config` (the folder holding the model's config.json, read offline) is given."""

    cls: type
    family: Family
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
        return not (self.family is Family.DIFFUSERS and quanto)


def load_with_owner(owner: OwnerLoad, device_map: Mapping[str, Any], *, name: str) -> nn.Module:
    """The component loaded by its owner onto `device_map` (module paths -> torch devices / "cpu"), in eval mode."""
    try:
        module = _single_file(owner, device_map) if owner.single_file else _from_pretrained(owner, device_map)
    except (OSError, ValueError, RuntimeError, ImportError, TypeError, KeyError) as error:
        raise PipelineLoadError(
            f"Component {name!r}: {owner.cls.__name__} could not be loaded by {owner.family.value} from "
            f"{str(owner.source)!r}: {type(error).__name__}: {error}"
        ) from error
    return module.eval()


def _from_pretrained(owner: OwnerLoad, device_map: Mapping[str, Any]) -> nn.Module:
    arguments: dict[str, Any] = {"device_map": dict(device_map), "variant": owner.variant}
    if owner.quantization is not None and not owner.quantization.pre_quantized:
        arguments["quantization_config"] = owner.quantization.config
    if owner.family is Family.TRANSFORMERS:
        return owner.cls.from_pretrained(owner.source, dtype=owner.dtype, **arguments)
    return owner.cls.from_pretrained(owner.source, torch_dtype=owner.dtype, **arguments)


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


def construct(cls: type, folder: Path, family: Family) -> nn.Module:
    """`cls` built from `folder/config.json` by its family's constructor."""
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise WeightsNotFoundError(f"{config_path} not found: component folder {folder.name!r} needs its config.json.")
    if family is Family.OWN:
        return cls(read_config(folder, cls.config_class))
    if family is Family.DIFFUSERS:
        return cls.from_config(cls.load_config(folder))
    return cls._from_config(cls.config_class.from_pretrained(folder))


def retie(module: nn.Module, family: Family) -> None:
    """Redo the constructor's weight ties, which `init_empty_weights()` breaks."""
    if family is Family.OWN:
        tie_weights(module, type(module)._tied_weights_keys)
    elif callable(getattr(module, "tie_weights", None)):
        module.tie_weights()


def load_without_device_map(cls: type, folder: Path, *, family: Family, dtype: torch.dtype | None,
                            variant: str | None, quantization_config: Any = None) -> Any:
    """A component loaded by its own class to the CPU, a quantized one by its owner's quantizer."""
    if family is Family.NON_MODULE:
        return cls.from_pretrained(folder)
    extra = {} if quantization_config is None else {"quantization_config": quantization_config}
    if family is Family.TRANSFORMERS:
        return cls.from_pretrained(folder, dtype=dtype, variant=variant, **extra).eval()
    # Ours and diffusers' take the same arguments.
    return cls.from_pretrained(folder, torch_dtype=dtype, variant=variant, **extra).eval()
