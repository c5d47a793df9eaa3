"""A plan of a local folder says which components' weights are missing: planning reads configs and headers
only, so a folder whose weights file was deleted plans as it did before, and only its load fails. A component
without weights is named (with why, from the checkpoint reader) when the folder evidently should hold them:
its own folder has weight files of another kind or name (an index without its shards, pickles, another variant),
another component has its weights, or this library saved the folder. A configs-only folder (the configs of a
Hub pipeline, written to plan) is planned without a word, as documented, and so is a Hub download, which fetches
configs only to plan."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..checkpoint import WeightsNotFoundError, find_weights
from ..folder.sources import ComponentSource, weights_name_for
from .meta_records import MetaComponent

# Files that hold (or index) weights, whatever their format.
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf", "*.pt",
                 "*.pth", "*.ckpt")


def missing_weights_notes(metas: Mapping[str, MetaComponent], sources: Mapping[str, ComponentSource], *,
                          variant: str | None, saved_here: bool) -> list[str]:
    """One plan note per component built from its folder without weights where weights were expected."""
    others_have = any(meta.weights is not None for meta in metas.values())
    notes = []
    for name, meta in metas.items():
        source = sources.get(name)
        if meta.weights is not None or source is None or meta.owner is not None and meta.owner.single_file:
            continue
        if others_have or saved_here or holds_weight_files(source.folder):
            notes.append(f"{name}: {why_missing(source.folder, source.cls, variant)} The plan sized it from its "
                         "config.json; loading it will fail until its weights are there.")
    return notes


def holds_weight_files(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


def why_missing(folder: Path, cls: type, variant: str | None) -> str:
    """The checkpoint reader's own words for the weights it cannot find in `folder`."""
    try:
        find_weights(folder, weights_name=weights_name_for(cls), variant=variant)
    except WeightsNotFoundError as error:
        return str(error)
    return f"no weights were read from {str(folder)!r}."
