"""From a pipeline folder to its components: which class each one is, where its files are, and the pipeline
object that holds them (a subclass built through its constructor, or a generic `Pipeline`).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from .hf_interop import Family, family_of, known_execution_order
from .model_index import ComponentSpec, ModelIndex, UntrustedClassError, resolve_class
from .components import PipelineComponentError, PipelineComponents, is_generic

# What a pipeline folder needs for planning (configs) and, in addition, for loading (weights).
PLAN_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model"]
LOAD_PATTERNS = PLAN_PATTERNS + ["*/*.safetensors"]


@dataclass(frozen=True, kw_only=True)
class ComponentSource:
    """One saved component: its name, class, family (how it is built) and subfolder."""

    name: str
    cls: type
    family: Family
    folder: Path

    @property
    def is_module(self) -> bool:
        return self.family is not Family.NON_MODULE


def resolve_pipeline_folder(pretrained: str | Path, *, weights: bool) -> Path:
    """A local folder as it is, or a hub id downloaded with only the files needed (configs; weights if asked)."""
    from .hub import resolve_folder

    return resolve_folder(pretrained, allow_patterns=LOAD_PATTERNS if weights else PLAN_PATTERNS)


def component_sources(index: ModelIndex, folder: Path, *, skip: Mapping[str, Any],
                      trust_remote_code: bool = False) -> dict[str, ComponentSource]:
    """Every present component the folder provides (those in `skip`, passed by the caller, excluded).
    Every class is resolved before any is built: a folder naming an untrusted class fails before any work."""
    known = tuple({type(value) for value in skip.values() if value is not None})
    sources = {}
    for name, spec in index.components.items():
        if spec.is_absent or name in skip:
            continue
        _check_subfolder_name(name)
        cls = resolve_class(spec, component=name, trust_remote_code=trust_remote_code, known=known)
        subfolder = folder / name
        if not subfolder.is_dir():
            raise PipelineComponentError(
                f"model_index.json lists component {name!r} ({spec.library}.{spec.class_name}) but the folder "
                f"{str(subfolder)!r} is missing; restore it, or pass {name}=... to from_pretrained."
            )
        sources[name] = ComponentSource(name=name, cls=cls, family=family_of(cls), folder=subfolder)
    return sources


def _check_subfolder_name(name: str) -> None:
    """A component name is a subfolder of the pipeline folder: never a path that leaves it."""
    if name in (".", "..") or "/" in name or "\\" in name or Path(name).is_absolute():
        raise PipelineComponentError(
            f"model_index.json names component {name!r}, which is not a plain folder name; component names may "
            "not contain '/', '\\' or be '..'. Fix model_index.json."
        )


def load_non_module(source: ComponentSource) -> Any:
    """A tokenizer/scheduler/...: ours must load; a diffusers/transformers one that fails is reported and skipped."""
    if not callable(getattr(source.cls, "from_pretrained", None)):
        raise PipelineComponentError(
            f"Component {source.name!r}: class {source.cls.__module__}.{source.cls.__name__} has no "
            "from_pretrained(folder) method, so it cannot be loaded from the folder; give the class one, or pass "
            f"{source.name}=... to from_pretrained."
        )
    try:
        return source.cls.from_pretrained(source.folder)
    except Exception as error:
        if source.cls.__module__.split(".")[0] not in ("diffusers", "transformers"):
            raise
        warnings.warn(
            f"Component {source.name!r} ({source.cls.__name__}) could not be loaded from {source.folder} and is "
            f"skipped (set to None): {type(error).__name__}: {error}",
            stacklevel=3,
        )
        return None


def check_constructor(cls: type, index: ModelIndex, passed: Mapping[str, Any], *,
                      trust_remote_code: bool = False) -> None:
    """Before anything is built: every required constructor argument is available, every passed name is known."""
    if is_generic(cls):
        unknown = [name for name in passed if name not in index.components]
        if unknown:
            raise PipelineComponentError(
                f"{unknown} are not components of this folder (model_index.json lists {sorted(index.components)}); "
                "check the spelling of from_pretrained's keyword arguments."
            )
        _check_passed_modules(index, passed, trust_remote_code)
        return
    parameters = _constructor_parameters(cls)
    available = {name for name, spec in index.components.items() if not spec.is_absent} | set(passed)
    missing = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty and name not in available]
    if missing:
        raise PipelineComponentError(
            f"{cls.__name__} needs component(s) {missing} but the folder's model_index.json provides "
            f"{sorted(index.components)}; pass them to from_pretrained (e.g. {missing[0]}=...) or use a complete "
            "folder."
        )
    unknown = [name for name in passed if name not in parameters]
    if unknown:
        raise PipelineComponentError(
            f"{cls.__name__} has no component(s) {unknown}; its components are {sorted(parameters)}."
        )
    _check_passed_modules(index, passed, trust_remote_code)


def _check_passed_modules(index: ModelIndex, passed: Mapping[str, Any], trust_remote_code: bool) -> None:
    """Where the folder holds a model, a passed replacement must be a module (any class: a wrapped or
    quantized model is fine) or None; anything else would only fail at the first call, far from the cause."""
    for name, value in passed.items():
        spec = index.components.get(name)
        if value is None or isinstance(value, nn.Module) or spec is None or spec.is_absent:
            continue
        saved = _saved_class(spec, name, trust_remote_code)
        if isinstance(saved, type) and family_of(saved) is not Family.NON_MODULE:
            raise PipelineComponentError(
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
