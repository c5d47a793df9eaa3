"""Write weights as safetensors (sharded with an index json past `max_shard_size`), atomically.

Callers write into `atomic.atomic_folder` (re-exported here), the one atomic save of models and pipelines:
a save that fails half-way (full disk, a crash, an exception) leaves an existing checkpoint exactly as it was,
and what the save does not rewrite (other variants, a README) is carried over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from placement.sizes import parse_size

from .atomic import atomic_folder
from .checkpoint_errors import CheckpointSaveError, list_names
from .naming import DIFFUSERS_WEIGHTS_NAME, WeightsNaming

DEFAULT_MAX_SHARD_SIZE = "10GB"  # diffusers' default


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    weights_name: str = DIFFUSERS_WEIGHTS_NAME,
    variant: str | None = None,
    max_shard_size: int | str | None = None,
    offloaded: Mapping[str, torch.Tensor] | None = None,
) -> list[Path]:
    """Write `state_dict` into `folder` (which must exist); returns the files written, index last.

    One file when the tensors fit `max_shard_size` (int bytes or a size string such as "2GB"; default
    10GB), else numbered shards plus the index json `{"metadata": {"total_size"}, "weight_map"}`.
    Tensors that share memory must be de-duplicated by the caller (declare them as tied weights).
    `offloaded` serves the entries that are `meta` placeholders of weights kept elsewhere (a placed model's
    offloaded weights, `hooks.gather.offloaded_weights`): each is read when its shard is written, so no more
    than one shard of them is in memory at once.
    """
    folder = Path(folder)
    naming = WeightsNaming(weights_name=weights_name, variant=variant)
    offloaded = {} if offloaded is None else offloaded
    tensors = _checked_tensors(state_dict, offloaded)
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if limit <= 0:
        raise CheckpointSaveError(f"max_shard_size must be positive, got {max_shard_size!r}.")
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=naming.shard_pattern, max_shard_size=limit)
    written = []
    for filename, names in split.filename_to_tensors.items():
        path = folder / filename
        shard = {name: offloaded[name].contiguous() if tensors[name].is_meta else tensors[name] for name in names}
        save_file(shard, str(path), metadata={"format": "pt"})
        del shard  # the offloaded weights read for this shard go before the next shard's are read
        written.append(path)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        index_path = folder / naming.index_file
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(index_path)
    return written


def _checked_tensors(state_dict: Mapping[str, torch.Tensor],
                     offloaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    on_meta = [name for name, tensor in state_dict.items() if tensor.is_meta and name not in offloaded]
    if on_meta:
        raise CheckpointSaveError(
            f"Cannot save {list_names(on_meta)}: they are on the meta device and nothing serves them (never "
            "loaded). Load the model's weights (from_pretrained) before saving."
        )
    owners: dict[tuple, str] = {}
    shared = []
    for name, tensor in state_dict.items():
        if tensor.numel() == 0 or tensor.is_meta:  # a placeholder has no memory to share
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if key in owners:
            shared.append(f"{name} (shares memory with {owners[key]})")
        owners.setdefault(key, name)
    if shared:
        raise CheckpointSaveError(
            f"Tensors share memory: {', '.join(shared)}. safetensors stores each tensor once; declare them in "
            "the model's `_tied_weights_keys` ({tied name: source name}) so the tied copy is not saved."
        )
    return {name: tensor.detach() if tensor.is_meta else tensor.detach().contiguous()
            for name, tensor in state_dict.items()}


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "atomic_folder", "save_weights"]
