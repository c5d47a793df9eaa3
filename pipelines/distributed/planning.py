"""The replica plan of a pipeline folder: its modules built on meta (no weight read), `placement.plan_replicas`
with the pipeline's model graph and, with `call=`, each component's activation peak for that call."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import placement

from ..framework.loading import build_sized_on_meta, check_dtype_keys
from ..framework.model_index import ModelIndex
from ..framework.planning import call_activations
from ..framework.sources import (
    check_constructor,
    component_sources,
    construct_pipeline,
    load_non_module,
    resolve_pipeline_folder,
)


def plan_pipeline_replicas(pipeline_class: type, pretrained: str | Path, *, max_memory: Optional[Mapping] = None,
                           torch_dtype=None, call: Optional[Mapping[str, Any]] = None,
                           group_size: Optional[int] = None, strategy: str = "balanced") -> placement.ReplicaPlan:
    """How many replicas of the pipeline in `pretrained` this machine's GPUs hold (see `placement.replicas`)."""
    folder = resolve_pipeline_folder(pretrained, weights=False)
    index = ModelIndex.read(folder)
    check_constructor(pipeline_class, index, {})
    sources = component_sources(index, folder, skip={})
    check_dtype_keys(torch_dtype, sources, {})
    components = {
        name: build_sized_on_meta(source, torch_dtype=torch_dtype, variant=None, weights_required=False)
        if source.is_module else load_non_module(source)
        for name, source in sources.items()
    }
    pipe = construct_pipeline(pipeline_class, index, components)
    modules = pipe.module_components
    activations = None if call is None else call_activations(pipe, modules, call, torch_dtype=torch_dtype)
    return placement.plan_replicas(modules, max_memory=max_memory, graph=pipe.graph_edges, dtype=torch_dtype,
                                   activations=activations, group_size=group_size, strategy=strategy)


def folder_pipeline_class(pretrained: str | Path) -> type:
    """The class `pretrained` names when it is one of this library's pipelines (so its own `__call__` and
    `activation_inputs` apply), else the generic `Pipeline` (which loads diffusers folders as their class)."""
    import pipelines

    from ..framework.pipeline import Pipeline

    found = getattr(pipelines, ModelIndex.read(resolve_pipeline_folder(pretrained, weights=False)).class_name, None)
    return found if isinstance(found, type) and issubclass(found, Pipeline) else Pipeline
