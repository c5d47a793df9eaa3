"""Pipeline.save_pretrained: model_index.json plus one subfolder per component, in one atomic save.

A placed pipeline saves as it is, whatever each component's placement (whole, split, offloaded, per-call
residency, disk): every weight is read from where it lives (`hooks.gather`) and the placement is left alone.
Our models read their offloaded weights one shard at a time (`ModelMixin.save_pretrained`); diffusers' and
transformers' models, whose `save_pretrained` takes the whole `state_dict()`, get them filled into it
(`saving_placed`).

Components are written into the staging folder of `checkpoint.atomic.atomic_folder` (the same atomic save a
model uses); model_index.json is written last, with a fresh `_save_id` that a load checks to be sure all the
components it read come from one save (see `snapshot`). Entries of an existing folder the save does not write
(a README, other variants' weights, a component now absent) are carried over; an existing component's weights of
the variant being saved are replaced wholesale, so no stale shard or index survives.
"""

from __future__ import annotations

import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from torch import nn

from hooks.gather import offloaded_weights, offloaded_weights_in_state_dict, unserved_placeholders
from placement.errors import PlacementError
from placement.sizes import parse_size

from ..checkpoint.saving import atomic_folder
from ..errors import CheckpointSaveError
from ..checkpoint.files import CONFIG_NAME, WeightsNaming
from .component_classes import OwnModel, weights_name_for
from .model_index import MODEL_INDEX_NAME, SAVE_ID_KEY, ModelIndex, spec_for

if TYPE_CHECKING:
    from .components import PipelineComponents

FORMAT_VERSION = "1"


def save_pipeline(pipe: "PipelineComponents", target: Path, *, max_shard_size: int | str, variant: str | None) -> None:
    shard_bytes = parse_size(max_shard_size)
    components = pipe.components
    index = ModelIndex(
        class_name=type(pipe).__name__,
        components={name: spec_for(obj) for name, obj in components.items()},
        model_graph=[tuple(edge) for edge in pipe.model_graph],
        metadata={"_pipeline_placement_format": FORMAT_VERSION, SAVE_ID_KEY: uuid.uuid4().hex},
    )
    rewrites = rewritten_entries(components, variant)
    with atomic_folder(target, rewrites=rewrites) as staging:
        for name, obj in components.items():
            if obj is not None:
                _save_component(name, obj, staging / name, shard_bytes=shard_bytes, variant=variant)
        index.write(staging)


def rewritten_entries(components: dict[str, Any], variant: str | None) -> Callable[[str], bool]:
    """Old entries this save replaces even where it writes no file of that name: model_index.json, and per
    module component its config and every weight file of the saved variant (old shards of a now single file)."""
    namings = {name: WeightsNaming(weights_name=_weights_name(obj), variant=variant)
               for name, obj in components.items() if isinstance(obj, nn.Module)}

    def rewrites(path: str) -> bool:
        if path == MODEL_INDEX_NAME:
            return True
        component, _, file_name = path.partition("/")
        naming = namings.get(component)
        return naming is not None and "/" not in file_name and (file_name == CONFIG_NAME or naming.owns(file_name))

    return rewrites


def _weights_name(module: nn.Module) -> str:
    try:
        return weights_name_for(type(module))
    except PlacementError:  # a module class we cannot build: its own save_pretrained names its files
        return getattr(module, "weights_name", "")


def _save_component(name: str, obj: Any, folder: Path, *, shard_bytes: int, variant: str | None) -> None:
    save = getattr(obj, "save_pretrained", None)
    if save is None:
        raise CheckpointSaveError(
            f"Component {name!r} ({type(obj).__name__}) has no save_pretrained(folder) method, so it cannot be "
            "saved; give its class save_pretrained/from_pretrained or register it as None."
        )
    if isinstance(obj, OwnModel):
        save(folder, max_shard_size=shard_bytes, variant=variant)  # reads offloaded weights shard by shard
    elif isinstance(obj, nn.Module):
        with saving_placed(name, obj):
            save(folder, max_shard_size=shard_bytes, variant=variant)
    else:
        save(folder)


@contextmanager
def saving_placed(name: str, module: nn.Module) -> Iterator[None]:
    """While a diffusers or transformers model's own `save_pretrained` runs: its `state_dict()` holds its
    offloaded weights read into memory (all of them at once: those writers take the whole state dict), and
    transformers' warning about saving offloaded modules is not shown (the weights are all there)."""
    unserved = unserved_placeholders(module, offloaded_weights(module))
    if unserved:
        raise CheckpointSaveError(
            f"Component {name!r} has {len(unserved)} weights that were never loaded (e.g. {unserved[0]!r}: on the "
            "meta device, and no offload hook or store holds them); load them before saving."
        )
    with offloaded_weights_in_state_dict(module):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
            yield
