"""The pipeline object a load builds around its components (`cls`, a generic `Pipeline`, or the diffusers class
its folder names), and the checks made before any module is built."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ..errors import FolderError, UntrustedClassError
from ..folder.families import family_of
from ..folder.components import PipelineComponents, is_generic
from ..folder.model_index import ComponentSpec, ModelIndex, resolve_class
from ..hf.diffusers_pipeline import (
    build_diffusers_pipeline,
    check_diffusers_components,
    diffusers_pipeline_class,
    is_diffusers_folder,
    known_execution_order,
)
from ..hf.loading_keywords import unknown_pipeline_keywords
from .request import PIPELINE_ARGUMENTS


def target_class(cls: type, index: ModelIndex, generic: bool) -> type:
    """`Pipeline.from_pretrained` of a diffusers folder builds the diffusers class (unless `generic`)."""
    if not is_generic(cls):
        if generic:
            raise FolderError(
                f"generic=True loads a folder as the generic pipelines.Pipeline; {cls.__name__} is a pipeline "
                "class of its own: call pipelines.Pipeline.from_pretrained(folder, generic=True) instead."
            )
        return cls
    if generic or not is_diffusers_folder(index):
        return cls
    return diffusers_pipeline_class(index)


def check_components(target: type, cls: type, index: ModelIndex, passed: Mapping[str, Any], *,
                     trust_remote_code: bool) -> None:
    """Before anything is built: the folder and the passed components give `target` what it needs."""
    if target is cls:
        check_constructor(cls, index, passed, trust_remote_code=trust_remote_code)
    else:
        check_diffusers_components(target, index, passed, arguments=PIPELINE_ARGUMENTS)


def construct(target: type, index: ModelIndex, components: Mapping[str, Any], folder: Path | str) -> Any:
    """The pipeline object holding `components`: ours, or a diffusers class through its own constructor."""
    if is_generic(target) or issubclass(target, PipelineComponents):
        return construct_pipeline(target, index, components)
    return build_diffusers_pipeline(target, index, components, name_or_path=str(folder))


def install_component(pipe: Any, name: str, module: Any) -> None:
    """Replace component `name` (the meta module planned with, by its owner's loaded one) through the pipeline's
    own registration, so diffusers' config stays consistent."""
    if isinstance(pipe, PipelineComponents):
        pipe.register_components(**{name: module})
    else:
        pipe.register_modules(**{name: module})


def check_constructor(cls: type, index: ModelIndex, passed: Mapping[str, Any], *,
                      trust_remote_code: bool = False) -> None:
    """Before anything is built: every required constructor argument is available, every passed name is known."""
    if is_generic(cls):
        unknown = [name for name in passed if name not in index.components]
        if unknown:
            raise unknown_pipeline_keywords(unknown, pipeline=cls.__name__, components=index.components,
                                            arguments=PIPELINE_ARGUMENTS)
        _check_passed_modules(index, passed, trust_remote_code)
        return
    parameters = _constructor_parameters(cls)
    available = {name for name, spec in index.components.items() if not spec.is_absent} | set(passed)
    missing = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty and name not in available]
    if missing:
        raise FolderError(
            f"{cls.__name__} needs component(s) {missing} but the folder's model_index.json provides "
            f"{sorted(index.components)}; pass them to from_pretrained (e.g. {missing[0]}=...) or use a complete "
            "folder."
        )
    unknown = [name for name in passed if name not in parameters]
    if unknown:
        raise unknown_pipeline_keywords(unknown, pipeline=cls.__name__, components=parameters,
                                        arguments=PIPELINE_ARGUMENTS)
    _check_passed_modules(index, passed, trust_remote_code)


def _check_passed_modules(index: ModelIndex, passed: Mapping[str, Any], trust_remote_code: bool) -> None:
    """Where the folder holds a model, a passed replacement must be a module (any class: a wrapped or
    quantized model is fine) or None; anything else would only fail at the first call, far from the cause."""
    for name, value in passed.items():
        spec = index.components.get(name)
        if value is None or isinstance(value, nn.Module) or spec is None or spec.is_absent:
            continue
        saved = _saved_class(spec, name, trust_remote_code)
        if isinstance(saved, type) and family_of(saved).is_module:
            raise FolderError(
                f"from_pretrained({name}=...) got a {type(value).__name__}, but {name!r} is a model in this folder "
                f"({spec.library}.{spec.class_name}); pass an nn.Module (e.g. {spec.class_name}.from_pretrained"
                f"(...)), or None to leave it out."
            )


def _saved_class(spec: ComponentSpec, name: str, trust_remote_code: bool) -> type | None:
    try:
        return resolve_class(spec, component=name, trust_remote_code=trust_remote_code)
    except UntrustedClassError:
        return None  # the passed value replaces it: the saved class is never needed, so never imported


def construct_pipeline(cls: type, index: ModelIndex, components: Mapping[str, Any]) -> PipelineComponents:
    """A subclass through its constructor (index entries it does not take are ignored with a warning);
    the base class as a generic pipeline: every component an attribute, the folder's or a known graph."""
    if is_generic(cls):
        pipe = cls()
        pipe.register_components(**{name: components.get(name) for name in _ordered_names(index, components)})
        pipe.model_graph = generic_graph(index, pipe)
        pipe.folder_class_name = index.class_name  # what call= planning looks its inputs up by
        return pipe
    parameters = _constructor_parameters(cls)
    ignored = [name for name in components if name not in parameters]
    if ignored:
        warnings.warn(f"{cls.__name__} does not take component(s) {ignored} from the folder; they are ignored.",
                      stacklevel=3)
    return cls(**{name: value for name, value in components.items() if name in parameters})


def generic_graph(index: ModelIndex, pipe: PipelineComponents) -> list[tuple[str, str]]:
    """The folder's own `_model_graph`, else a known diffusers pipeline's order, else model_index.json's order,
    as a chain over the module components present."""
    if index.model_graph is not None:
        return [tuple(edge) for edge in index.model_graph]
    modules = [name for name, obj in pipe.components.items() if isinstance(obj, nn.Module)]
    known = known_execution_order(index.class_name) or []
    order = [name for name in known if name in modules] + [name for name in modules if name not in known]
    return list(zip(order, order[1:]))


def _ordered_names(index: ModelIndex, components: Mapping[str, Any]) -> list[str]:
    return list(index.components) + [name for name in components if name not in index.components]


def _constructor_parameters(cls: type) -> dict[str, inspect.Parameter]:
    signature = inspect.signature(cls.__init__)
    return {
        name: parameter
        for name, parameter in list(signature.parameters.items())[1:]
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
