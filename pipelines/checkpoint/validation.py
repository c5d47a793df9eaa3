"""Compare a checkpoint's tensor names and shapes with a model's, before anything is loaded."""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch
from torch import nn

from ..errors import FolderError
from .checkpoint_errors import CheckpointShapeError, list_names
from .index import WeightsIndex


def expected_shapes(module: nn.Module, model_tensors: Mapping[str, torch.Tensor] | None = None
                    ) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must provide: parameters and persistent buffers (works on meta)."""
    tensors = module.state_dict(keep_vars=True) if model_tensors is None else model_tensors
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def validate_weights(
    module: nn.Module,
    weights: WeightsIndex,
    *,
    tied_weights: Mapping[str, str] | None = None,
    ignore_unexpected: Iterable[str] = (),
    model_tensors: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Raise if a key is missing or unexpected (all named) or a shape differs (named, both shapes).

    Tied weights (`{tied name: source name}`) may be absent: they are re-tied to their source after loading.
    Checkpoint keys matching a regex of `ignore_unexpected` may be present without the model having them.
    `model_tensors`: `module.state_dict(keep_vars=True)` when the caller has it already.
    """
    expected = expected_shapes(module, model_tensors)
    tied = set(tied_weights or ())
    present = set(weights.tensors)
    ignored = [re.compile(pattern) for pattern in ignore_unexpected]
    missing = sorted(set(expected) - present - tied)
    unexpected = sorted(k for k in present - set(expected) if not any(p.search(k) for p in ignored))
    where = _describe(weights)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) the model needs: {list_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) the model does not have: {list_names(unexpected)}")
        raise FolderError(
            f"Checkpoint {where} does not match {type(module).__name__}: {'; '.join(parts)}. "
            "Check that the config and the weights come from the same model."
        )
    mismatched = _shape_mismatches(expected, weights, present & set(expected))
    if mismatched:
        raise CheckpointShapeError(
            f"Checkpoint {where} does not match {type(module).__name__}: shape mismatch for "
            f"{'; '.join(mismatched)}. Check that config.json matches the weights."
        )


def _shape_mismatches(expected, weights: WeightsIndex, names: Iterable[str]) -> list[str]:
    mismatched = []
    for name in sorted(names):
        entry = weights.tensors[name]
        if tuple(entry.shape) != expected[name]:
            mismatched.append(
                f"{name!r}: checkpoint {list(entry.shape)} in {entry.file.name!r}, model {list(expected[name])}"
            )
    return mismatched


def _describe(weights: WeightsIndex) -> str:
    source = (weights.index_file or weights.files[0]) if weights.files else weights.folder
    return repr(str(source))
