"""Components read from a single-file checkpoint (`hf.single_file`): built on meta by diffusers' own single-file
path, read by its `from_single_file` (`WeightsReader.OWNER`) with the model's config from a local folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import LoadError
from ..folder.sources import ComponentSource, Family, family_of
from ..hf.owner_loading import OwnerLoad
from ..hf.quantizers import ComponentQuantization, method_of, requested_quantization
from ..hf.single_file import (
    build_on_meta, checkpoint_float_dtype, gguf_quantization, holds_component, is_gguf, meta_checkpoint,
)
from .layerwise import with_layerwise_casting
from .meta_records import MetaComponent, WeightsReader


def build_single_file_component(name: str, cls: type, path: Path, config_folder: Path, *,
                                dtype: torch.dtype | None, quantization_config: Any = None,
                                layerwise_casting: torch.dtype | None = None) -> MetaComponent:
    """Component `name` (a `cls`) as diffusers' `from_single_file(path, config=config_folder)` loads it, on meta;
    a GGUF file with diffusers' GGUF quantizer (its packed blocks kept, layers computing in `dtype`)."""
    if family_of(cls) is not Family.DIFFUSERS:
        raise LoadError(
            f"{path.name}: single-file checkpoints are read by diffusers for its own models; {cls.__name__} is not "
            "one. Load its folder instead."
        )
    requested = requested_quantization(quantization_config, name, Family.DIFFUSERS)
    if is_gguf(path):
        if requested is not None:
            raise LoadError(f"{path.name} is quantized already (GGUF); leave quantization_config out for {name!r}.")
        load_dtype = dtype or torch.bfloat16
        quantization = gguf_quantization(load_dtype)
    else:
        load_dtype = dtype or checkpoint_float_dtype(path)
        quantization = None if requested is None else ComponentQuantization(
            config=requested, pre_quantized=False, method=method_of(requested))
    module = build_on_meta(cls, path, config_folder, dtype=load_dtype, quantization=quantization)
    owner = OwnerLoad(cls=cls, family=Family.DIFFUSERS, source=path, dtype=load_dtype, quantization=quantization,
                      single_file_config=config_folder)
    meta = MetaComponent(name=name, module=module, family=Family.DIFFUSERS, weights=None, dtype=dtype, load_dtypes={},
                         keep_in_fp32=(), tied_weights={}, reader=WeightsReader.OWNER, owner=owner)
    return with_layerwise_casting(meta, layerwise_casting)


def single_file_sources(sources: Mapping[str, ComponentSource], path: Path | None) -> set[str]:
    """The module components a pipeline's single file holds: its diffusers models whose weights the file has
    (as saved, or in the original layout diffusers converts), tested on meta; none without a file. A file
    holding none of them is an error naming them."""
    if path is None:
        return set()
    checkpoint = meta_checkpoint(path)
    held = {name for name, source in sources.items()
            if source.family is Family.DIFFUSERS and holds_component(source.cls, checkpoint, source.folder)}
    if not held:
        models = {name: source.cls.__name__ for name, source in sources.items()}
        raise LoadError(
            f"{path.name} holds the weights of none of this pipeline's diffusers models {models} (as saved, or in "
            "an original layout diffusers converts); check that config= is the pipeline this file belongs to."
        )
    return held


__all__ = ["build_single_file_component", "single_file_sources"]
