"""The atomic save of what this library hands out but diffusers or transformers write: every diffusers pipeline and
every diffusers/transformers model it returns, placed or not, gets a `save_pretrained` that runs the owner's own
writer into `atomic_folder`'s staging folder (see pipelines/checkpoint/saving.py). The owners write into the target
in place: a full disk midway leaves one save's files beside another's, and the folder then loads without a word.
Our own models (`pipelines.ModelMixin`) and generic pipelines save atomically by themselves."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from placement.errors import PlacementError

from ..checkpoint.files import CONFIG_NAME, WeightsNaming
from ..checkpoint.saving import atomic_folder, check_target
from ..folder.components import PipelineComponents, saving_placed
from ..folder.families import OwnModel, weights_name_for
from .diffusers_pipeline import save_placed
from .quiet import quiet


def save_owner_model(model: nn.Module, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
    """`type(model).save_pretrained(save_directory, ...)` with its owner's arguments, written atomically in any
    placement: config.json and the saved variant's weight files are replaced, every other entry there is kept."""
    save = type(model).save_pretrained
    arguments = inspect.signature(save).bind(model, save_directory, *args, **kwargs).arguments
    naming = WeightsNaming(weights_name=_weights_name(model), variant=arguments.get("variant"))
    target = check_target(save_directory)
    if arguments.get("push_to_hub"):
        kwargs.setdefault("repo_id", target.name)  # the owner would name the repository after the staging folder
    with quiet(), atomic_folder(target, rewrites=lambda name: name == CONFIG_NAME or naming.owns(name)) as staging:
        with saving_placed(type(model).__name__, model):
            save(model, str(staging), *args, **kwargs)


def _weights_name(model: nn.Module) -> str:
    try:
        return weights_name_for(type(model))
    except PlacementError:  # neither family's class: its own writer names its files; config.json is still ours
        return ""


def saves_in_place(obj: Any) -> bool:
    """A diffusers/transformers model or a diffusers pipeline: its class's `save_pretrained` writes in place."""
    if isinstance(obj, (OwnModel, PipelineComponents)) or not callable(getattr(type(obj), "save_pretrained", None)):
        return False
    return isinstance(obj, nn.Module) or _is_diffusers_pipeline(obj)


def _is_diffusers_pipeline(obj: Any) -> bool:
    try:
        import diffusers
    except ImportError:
        return False
    return isinstance(obj, diffusers.DiffusionPipeline)


class AtomicSave:
    """An instance's `save_pretrained`: `save(obj, ...)`, with the signature of the class's own method (diffusers'
    pipeline save passes `variant` and `safe_serialization` to a component only where the signature names them).
    A plain object, not a bound local function, so the model still pickles and deep-copies."""

    def __init__(self, obj: Any, save) -> None:
        self.obj, self.save = obj, save

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(type(self.obj).save_pretrained)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # without `self`

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return self.save(self.obj, *args, **kwargs)


def save_atomically(obj: Any) -> Any:
    """`obj` with its instance's `save_pretrained` going through the atomic save (a no-op for what saves atomically
    by itself); returns `obj`."""
    if saves_in_place(obj):
        obj.save_pretrained = AtomicSave(obj, save_owner_model if isinstance(obj, nn.Module) else save_placed)
    return obj


def save_components_atomically(pipe: Any, names: Iterable[str]) -> None:
    """The pipeline and its components `names` (those the load built, not those passed in) save atomically."""
    save_atomically(pipe)
    for name in names:
        save_atomically(getattr(pipe, name, None))


__all__ = ["save_atomically", "save_components_atomically", "save_owner_model"]
