"""What the meta builder hands to planning and placing: `MetaComponent`, and how its weights are read."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

import torch
from torch import nn

from ..checkpoint import WeightsIndex
from ..folder.sources import Family
from ..hf.owner_loading import OwnerLoad


class WeightsReader(Enum):
    """How a component's weights are read into its meta module: chosen when it is built (`build_component`), so
    planning and placing never guess.

    STREAM is this library's loader: each tensor from its safetensors file straight to its planned device
    (`placing.place_component`). OWNER is the library that owns the format (transformers checkpoints whose keys
    are renamed on load, quantized components, single files, GGUF): its `from_pretrained` / `from_single_file`
    given our plan's device map, then our runtime (`owner_reading`).
    """

    STREAM = "stream"
    OWNER = "owner"


@dataclass(frozen=True, kw_only=True)
class MetaComponent:
    """A module component built on meta and sized exactly, with what its load needs.

    `weights` is None when the folder has no weight files (planning from configs only). `load_dtypes` maps each
    checkpoint tensor to the dtype it loads as; `keep_in_fp32` names the submodules kept float32 at `dtype`
    (sizing's rule, so the plan and the load agree); `tied_weights` maps each tied parameter the checkpoint
    lacks to the tensor that serves it. `owner`: the owner's load call, for `WeightsReader.OWNER`.
    `layerwise_casting`: the storage dtype of fp8 layerwise casting when the load applies it."""

    name: str
    module: nn.Module
    family: Family
    weights: WeightsIndex | None
    dtype: torch.dtype | None
    load_dtypes: Mapping[str, torch.dtype]
    keep_in_fp32: tuple[str, ...]
    tied_weights: Mapping[str, str]
    reader: WeightsReader
    owner: OwnerLoad | None = None
    layerwise_casting: torch.dtype | None = None

    @property
    def quantization(self):
        """The component's `hf.quantizers.ComponentQuantization`, None when it is not quantized."""
        return None if self.owner is None else self.owner.quantization

    @property
    def sizing_dtype(self) -> torch.dtype | None:
        """The dtype `placement.plan` is told to size at: the requested one, except when layerwise casting stores
        some weights smaller (its meta tensors already hold every load dtype; a requested dtype would count the
        fp8 weights at the compute dtype)."""
        return None if self.layerwise_casting is not None else self.dtype

    @property
    def dtype_origin(self) -> str:
        """Where the dtype the component was sized at comes from, for the plan to state."""
        if self.dtype is not None:
            return "torch_dtype"
        if self.weights is not None or (self.owner is not None and self.owner.single_file):
            return "checkpoint"
        return "config.json only, no weights read: give torch_dtype to plan for the checkpoint's dtype"
