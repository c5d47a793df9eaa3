"""`save_pretrained()` of a diffusers pipeline we placed: diffusers' own save, through our atomic save, with every
weight read from where it lives.

diffusers' `DiffusionPipeline.save_pretrained` writes into the target folder directly, component by component:
a failure half-way leaves a half-written folder (a `vae/config.json` and nothing else), and each model's save
deletes the old shards it finds there. And a placed model holds `meta` placeholders for its offloaded and disk
weights, which diffusers' and transformers' writers cannot copy. So the placed pipeline's `save_pretrained` runs
diffusers' own save (its model_index.json, its per-component writers, tokenizers and schedulers included) into
the staging folder of `checkpoint.atomic.atomic_folder`, with each model's `state_dict()` holding its weights
read from wherever they live (`folder.pipeline_saving.saving_placed`); then the staging folder replaces the
target, keeping what the save does not own (a README, other variants' weights). The placement is unchanged.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint.saving import atomic_folder, check_target
from ..folder.components import rewritten_entries, saving_placed
from .quiet import quiet


def save_placed(pipe: Any, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
    """`type(pipe).save_pretrained(save_directory, ...)` (diffusers' arguments: `safe_serialization`, `variant`,
    `max_shard_size`, `push_to_hub`, ...), written atomically and working in any placement (see the module
    docstring). With `push_to_hub`, the repository is named after `save_directory` unless `repo_id` is given."""
    save = type(pipe).save_pretrained
    arguments = inspect.signature(save).bind(pipe, save_directory, *args, **kwargs).arguments
    variant = arguments.get("variant")
    target = check_target(save_directory)
    if arguments.get("push_to_hub"):
        kwargs.setdefault("repo_id", target.name)  # diffusers would name it after the staging folder
    modules = {name: obj for name, obj in pipe.components.items() if isinstance(obj, nn.Module)}
    with quiet(), atomic_folder(target, rewrites=rewritten_entries(pipe.components, variant)) as staging:
        with ExitStack() as gathered:
            for name, module in modules.items():
                gathered.enter_context(saving_placed(name, module))
            save(pipe, str(staging), *args, **kwargs)


__all__ = ["save_placed"]
