"""Write weights as safetensors (sharded with an index json past `max_shard_size`), atomically.

`atomic_folder` writes into a temporary folder next to the target and renames it into place, so a save
that fails half-way (full disk, a crash, an exception) leaves an existing checkpoint exactly as it was.
Files of the target that the save does not rewrite (other variants, a README) are carried over as hard
links: no copy of other weights is made.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from placement.sizes import parse_size

from .errors import CheckpointSaveError, list_names
from .naming import DIFFUSERS_WEIGHTS_NAME, WeightsNaming

DEFAULT_MAX_SHARD_SIZE = "10GB"  # diffusers' default


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    weights_name: str = DIFFUSERS_WEIGHTS_NAME,
    variant: str | None = None,
    max_shard_size: int | str | None = None,
) -> list[Path]:
    """Write `state_dict` into `folder` (which must exist); returns the files written, index last.

    One file when the tensors fit `max_shard_size` (int bytes or a size string such as "2GB"; default
    10GB), else numbered shards plus the index json `{"metadata": {"total_size"}, "weight_map"}`.
    Tensors that share memory must be de-duplicated by the caller (declare them as tied weights).
    """
    folder = Path(folder)
    naming = WeightsNaming(weights_name=weights_name, variant=variant)
    tensors = _checked_tensors(state_dict)
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if limit <= 0:
        raise CheckpointSaveError(f"max_shard_size must be positive, got {max_shard_size!r}.")
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=naming.shard_pattern, max_shard_size=limit)
    written = []
    for filename, names in split.filename_to_tensors.items():
        path = folder / filename
        save_file({name: tensors[name] for name in names}, str(path), metadata={"format": "pt"})
        written.append(path)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        index_path = folder / naming.index_file
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(index_path)
    return written


def _checked_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    on_meta = [name for name, tensor in state_dict.items() if tensor.device.type == "meta"]
    if on_meta:
        raise CheckpointSaveError(
            f"Cannot save {list_names(on_meta)}: they are on the meta device (offloaded or never loaded). "
            "Undispatch the model (which brings offloaded weights back) before saving."
        )
    owners: dict[tuple, str] = {}
    shared = []
    for name, tensor in state_dict.items():
        if tensor.numel() == 0:
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
    return {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}


@contextmanager
def atomic_folder(target: str | Path, *, rewrites: Callable[[str], bool]) -> Iterator[Path]:
    """Yield a temporary folder next to `target`; on success it replaces `target`, on failure it vanishes.

    Top-level entries of an existing `target` for which `rewrites(name)` is False are hard-linked into the
    new folder first, so they survive the swap. The swap is two renames on the same filesystem.
    """
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise CheckpointSaveError(f"Cannot save into {str(target)!r}: it exists and is not a folder.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = target.parent / f".{target.name}.saving-{tag}"
    staging.mkdir()
    try:
        if target.is_dir():
            _carry_over(target, staging, rewrites)
        yield staging
        _swap(staging, target, target.parent / f".{target.name}.replaced-{tag}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _carry_over(source: Path, staging: Path, rewrites: Callable[[str], bool]) -> None:
    for entry in source.iterdir():
        if rewrites(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, staging / entry.name, copy_function=_link_or_copy, symlinks=True)
        else:
            _link_or_copy(entry, staging / entry.name)


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links: copy instead
        shutil.copy2(source, destination)


def _swap(staging: Path, target: Path, backup: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(backup, target)  # put the old checkpoint back before reporting the failure
        raise
    shutil.rmtree(backup, ignore_errors=True)
