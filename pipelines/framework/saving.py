"""Pipeline.save_pretrained: model_index.json plus one subfolder per component, written atomically.

Everything is written into a temporary folder next to the target and renamed into place only when every
component saved; a failure removes the temporary folder and leaves an existing checkpoint untouched.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from placement.errors import PlacementError
from placement.sizes import parse_size

from .model_index import ModelIndex, spec_for

if TYPE_CHECKING:
    from .components import PipelineComponents

FORMAT_VERSION = "1"


class PipelineSaveError(PlacementError, RuntimeError):
    """A component that cannot be saved (no save_pretrained, or weights not materialised)."""


def save_pipeline(pipe: "PipelineComponents", target: Path, *, max_shard_size: int | str, variant: str | None) -> None:
    shard_bytes = parse_size(max_shard_size)
    components = pipe.components
    index = ModelIndex(
        class_name=type(pipe).__name__,
        components={name: spec_for(obj) for name, obj in components.items()},
        model_graph=[tuple(edge) for edge in pipe.model_graph],
        metadata={"_pipeline_placement_format": FORMAT_VERSION},
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for name, obj in components.items():
            if obj is not None:
                _save_component(name, obj, staging / name, shard_bytes=shard_bytes, variant=variant)
        index.write(staging)
        _replace_atomically(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_component(name: str, obj: Any, folder: Path, *, shard_bytes: int, variant: str | None) -> None:
    save = getattr(obj, "save_pretrained", None)
    if save is None:
        raise PipelineSaveError(
            f"Component {name!r} ({type(obj).__name__}) has no save_pretrained(folder) method, so it cannot be "
            "saved; give its class save_pretrained/from_pretrained or register it as None."
        )
    if isinstance(obj, nn.Module):
        meta = [key for key, tensor in obj.state_dict().items() if tensor.device.type == "meta"]
        if meta:
            raise PipelineSaveError(
                f"Component {name!r} has {len(meta)} weights that are not materialised (e.g. {meta[0]!r}: "
                "disk-offloaded); call pipe.reset_device_map() before saving."
            )
        save(folder, max_shard_size=shard_bytes, variant=variant)
    else:
        save(folder)


def _replace_atomically(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing `target` is moved aside first and deleted only afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    retired = target.parent / f".{target.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)
