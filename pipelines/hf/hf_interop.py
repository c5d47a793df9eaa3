"""How each family of module class is built from its folder's config, and loaded by its own class.

Our own `ModelMixin`s (`Family.OWN`), diffusers models and transformers models all keep a `config.json` in their
subfolder, but each family builds from it its own way: ours validate it against `config_class`, diffusers'
`from_config(load_config(folder))`, transformers' `_from_config(config_class.from_pretrained(folder))`. The one
meta builder (`loading.meta.build_component`) calls `construct` under `init_empty_weights()`, then `retie`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import tie_weights
from ..errors import WeightsNotFoundError
from ..checkpoint.files import read_config
from ..folder.sources import Family

CONFIG_FILE = "config.json"


def construct(cls: type, folder: Path, family: Family) -> nn.Module:
    """`cls` built from `folder/config.json` by its family's constructor (under `init_empty_weights()` the
    weights stay on meta: no memory, no init cost)."""
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise WeightsNotFoundError(f"{config_path} not found: component folder {folder.name!r} needs its config.json.")
    if family is Family.OWN:
        return cls(read_config(folder, cls.config_class))
    if family is Family.DIFFUSERS:
        return cls.from_config(cls.load_config(folder))
    return cls._from_config(cls.config_class.from_pretrained(folder))


def retie(module: nn.Module, family: Family) -> None:
    """Redo the weight ties the constructor made: accelerate's `init_empty_weights()` breaks them. Ours from
    `_tied_weights_keys`; diffusers and transformers models by their own `tie_weights()`."""
    if family is Family.OWN:
        tie_weights(module, type(module)._tied_weights_keys)
    elif callable(getattr(module, "tie_weights", None)):
        module.tie_weights()


def load_without_device_map(cls: type, folder: Path, *, family: Family, dtype: torch.dtype | None,
                            variant: str | None, quantization_config: Any = None) -> Any:
    """A component loaded by its own class to the CPU (the no-device_map path of a pipeline); a quantized one by
    its owner's quantizer (`quantization_config`: the component's own config object)."""
    if family is Family.NON_MODULE:
        return cls.from_pretrained(folder)
    extra = {} if quantization_config is None else {"quantization_config": quantization_config}
    if family is Family.TRANSFORMERS:
        return cls.from_pretrained(folder, dtype=dtype, variant=variant, **extra).eval()
    # Ours and diffusers' take the same arguments.
    return cls.from_pretrained(folder, torch_dtype=dtype, variant=variant, **extra).eval()
