"""The replica plan of a pipeline folder: its modules built on meta (no weight read), `placement.plan_replicas`
with the pipeline's model graph and, with `call=`, each component's activation peak for that call."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import placement

from ..folder.model_index import ModelIndex
from ..folder.sources import component_sources, load_non_module, resolve_pipeline_folder
from ..loading.assembly import check_constructor, construct_pipeline
from ..loading.meta import build_from_source
from ..loading.planning import call_activations
from ..loading.request import DtypeRequest


def plan_pipeline_replicas(pipeline_class: type, pretrained: str | Path, *, max_memory: Optional[Mapping] = None,
                           torch_dtype=None, call: Optional[Mapping[str, Any]] = None,
                           group_size: Optional[int] = None, strategy: str = "balanced") -> placement.ReplicaPlan:
    """How many replicas of the pipeline in `pretrained` this machine's GPUs hold (see `placement.replicas`)."""
    folder = resolve_pipeline_folder(pretrained, weights=False)
    index = ModelIndex.read(folder)
    check_constructor(pipeline_class, index, {})
    sources = component_sources(index, folder, skip={})
    dtypes = DtypeRequest.parse(torch_dtype)
    dtypes.check_names([name for name, source in sources.items() if source.is_module], of="pipeline")
    components = {
        name: build_from_source(source, dtype=dtypes.for_component(name), variant=None, weights_required=False).module
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
