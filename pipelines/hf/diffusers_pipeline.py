"""A folder whose model_index.json names a diffusers pipeline class loads as THAT class, every module placed by our
planner. Its `reset_device_map()` is replaced by ours (diffusers' cannot bring disk-offloaded weights back), and
its `save_pretrained()` runs diffusers' own save through our atomic save with every weight read from where it
lives (diffusers writes into the target directly and cannot copy `meta` placeholders)."""

from __future__ import annotations

import inspect
import types
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable, Mapping

from torch import nn

from ..checkpoint.saving import atomic_folder, check_target
from ..errors import LoadError, MissingComponentsError
from ..folder.class_registry import find_library_class, find_registered_named
from ..folder.components import origins_of, restore_components, rewritten_entries, saving_placed
from ..folder.model_index import ModelIndex
from .loading_keywords import unknown_pipeline_keywords
from .quiet import quiet


def save_placed(pipe: Any, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
    """`type(pipe).save_pretrained(save_directory, ...)` with diffusers' arguments, written atomically in any
    placement; with `push_to_hub`, the repository is named after `save_directory` unless `repo_id` is given."""
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


GENERIC_HINT = "pass generic=True to load the folder's components as a generic pipelines.Pipeline instead"


def is_diffusers_folder(index: ModelIndex) -> bool:
    """Written by diffusers (its version stamp), or naming a class the installed diffusers has; never a folder naming
    one of this library's pipeline classes."""
    if find_library_class(index.class_name) is not None:
        return False
    if "_diffusers_version" in index.metadata:
        return True
    try:
        import diffusers
    except ImportError:
        return False
    return isinstance(getattr(diffusers, index.class_name, None), type)


def diffusers_pipeline_class(index: ModelIndex) -> type:
    """The diffusers class `_class_name` names; an error naming it when the installed diffusers lacks it."""
    try:
        import diffusers
    except ImportError as error:
        raise LoadError(
            f"model_index.json names the diffusers pipeline {index.class_name!r}, but diffusers is not installed: "
            f"pip install 'pipeline-placement[hf]', or {GENERIC_HINT}."
        ) from error
    found = getattr(diffusers, index.class_name, None) or find_registered_named(index.class_name)
    if not (isinstance(found, type) and issubclass(found, diffusers.DiffusionPipeline)):
        raise LoadError(
            f"model_index.json names the pipeline class {index.class_name!r}, which diffusers "
            f"{diffusers.__version__} does not have; for your own DiffusionPipeline subclass, register it first "
            f"(pipelines.register_class({index.class_name})), else upgrade diffusers, or {GENERIC_HINT}."
        )
    return found


def check_diffusers_components(pipeline_class: type, index: ModelIndex, passed: Mapping[str, Any], *,
                               arguments: Iterable[str]) -> None:
    """Before anything is built: every component the class requires is in the folder or passed, and every
    passed name is one of its components (else the closest of them or of the entry's `arguments`)."""
    present = {name for name, spec in index.components.items() if not spec.is_absent} | set(passed)
    expected, missing = _required(pipeline_class, present)
    if missing:
        listed = {name: spec.to_json_value() for name, spec in index.components.items() if name in missing}
        raise MissingComponentsError(
            f"{pipeline_class.__name__} needs component(s) {missing}, which the folder does not provide "
            f"(model_index.json: {listed or 'not listed'}); restore the subfolder(s), pass them to "
            f"from_pretrained (e.g. {missing[0]}=...), or {GENERIC_HINT}.",
            missing=missing,
        )
    unknown = [name for name in passed if name not in expected]
    if unknown:
        raise unknown_pipeline_keywords(unknown, pipeline=pipeline_class.__name__, components=expected,
                                        arguments=arguments)


def _required(pipeline_class: type, present: Iterable[str]) -> tuple[list[str], list[str]]:
    """The components the class's constructor takes, and those of them it requires that are not `present`."""
    expected, _ = pipeline_class._get_signature_keys(pipeline_class)
    optional = set(pipeline_class._optional_components or ())
    return expected, [name for name in expected if name not in present and name not in optional]


def build_diffusers_pipeline(pipeline_class: type, index: ModelIndex, components: Mapping[str, Any], *,
                             name_or_path: str) -> Any:
    """`pipeline_class(**components, **settings)` as `DiffusionPipeline.from_pretrained` calls it: absent
    optional components None, pipeline settings (requires_safety_checker, ...) from model_index.json."""
    expected, optional_parameters = pipeline_class._get_signature_keys(pipeline_class)
    arguments = {name: components.get(name) for name in expected}
    arguments.update({name: index.metadata[name] for name in optional_parameters if name in index.metadata})
    accepted = inspect.signature(pipeline_class.__init__).parameters
    pipe = pipeline_class(**{name: value for name, value in arguments.items() if name in accepted})
    pipe.register_to_config(_name_or_path=name_or_path)
    pipe.placement_plan = None
    return pipe


def module_components(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's nn.Module components in execution order (`model_cpu_offload_seq`, then the rest)."""
    modules = {name: obj for name, obj in pipe.components.items() if isinstance(obj, nn.Module)}
    return {name: modules[name] for name in execution_order(type(pipe), modules)}


def execution_order(pipeline_class: type, modules: Mapping[str, Any]) -> list[str]:
    sequence = getattr(pipeline_class, "model_cpu_offload_seq", None) or ""
    known = [name for name in sequence.split("->") if name in modules]
    return known + [name for name in modules if name not in known]


def known_execution_order(class_name: str) -> list[str] | None:
    """The execution order of a known diffusers pipeline class (`model_cpu_offload_seq`), if importable."""
    try:
        import diffusers
    except ImportError:
        return None
    sequence = getattr(getattr(diffusers, class_name, None), "model_cpu_offload_seq", None)
    return sequence.split("->") if isinstance(sequence, str) else None


def graph_edges(pipeline_class: type, modules: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A chain in execution order: what each diffusers pipeline's `model_cpu_offload_seq` says."""
    order = execution_order(pipeline_class, modules)
    return list(zip(order, order[1:]))


def attach_reset(pipe: Any) -> None:
    """Replace the instance's `reset_device_map` and `save_pretrained` by `reset_placement` and `save_placed`."""
    pipe.reset_device_map = types.MethodType(reset_placement, pipe)
    pipe.save_pretrained = types.MethodType(save_placed, pipe)


def reset_placement(pipe: Any) -> None:
    """What a diffusers user expects of `reset_device_map()`: every hook removed, the weights on the CPU (disk ones
    read back), each model's `hf_device_map` as before and components passed in as they came, so that `.to()`,
    the offload methods and `save_pretrained()` work."""
    restore_components(module_components(pipe), origins_of(pipe))
    pipe.hf_device_map = None
    pipe.placement_plan = None
    pipe._all_hooks = []


def is_capturable(pipe: Any) -> bool:
    """Whether `pipe` is a diffusers pipeline, or a generic pipeline of a folder naming one diffusers has."""
    try:
        import diffusers
    except ImportError:
        return False
    if isinstance(pipe, diffusers.DiffusionPipeline):
        return True
    found = getattr(diffusers, getattr(pipe, "folder_class_name", None) or "", None)
    return isinstance(found, type) and issubclass(found, diffusers.DiffusionPipeline)


def capturable(pipe: Any) -> Any:
    """The diffusers pipeline whose `__call__` a capture runs: `pipe`, or the class a generic pipeline's folder
    names, built from its components."""
    import diffusers

    from ..errors import CallSpecError

    if isinstance(pipe, diffusers.DiffusionPipeline):
        return pipe
    pipeline_class = getattr(diffusers, pipe.folder_class_name)
    components = pipe.components
    expected, missing = _required(pipeline_class, [name for name, obj in components.items() if obj is not None])
    if missing:
        raise CallSpecError(
            f"call= plans by running {pipeline_class.__name__}'s own __call__, which needs its {missing}: the folder "
            "does not have them. Add them (tokenizers and schedulers are small files, fetched with the configs "
            "from the Hub), or plan without call= (weights only)."
        )
    accepted = inspect.signature(pipeline_class.__init__).parameters
    return pipeline_class(**{name: components.get(name) for name in expected if name in accepted})
