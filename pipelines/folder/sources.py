"""From a pipeline folder to its components: which class each one is and where its files are."""

from __future__ import annotations

import errno
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..checkpoint.files import CLASS_NAME_KEY, CONFIG_NAME, read_config_dict
from ..errors import FolderError
from .class_registry import LIBRARY, find_library_class
from .component_classes import Family, family_of
from .hub import HubOptions, resolve_folder
from .model_index import ComponentSpec, ModelIndex, resolve_class

# What a pipeline folder needs for planning (configs) and, in addition, for loading (weights).
PLAN_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model"]
LOAD_PATTERNS = PLAN_PATTERNS + ["*/*.safetensors"]
PICKLE_PATTERNS = ["*/*.bin", "*/*.bin.index.json"]  # fetched only on the explicit opt-in (use_safetensors=False)


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


def resolve_pipeline_folder(pretrained: str | Path, *, weights: bool, hub: HubOptions = HubOptions()) -> Path:
    """A local folder as it is, or a hub id downloaded with only the files needed (configs; weights if asked)."""
    return resolve_folder(pretrained, allow_patterns=LOAD_PATTERNS if weights else PLAN_PATTERNS, hub=hub)


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
        _check_not_a_loop(subfolder, folder, name)
        if not subfolder.is_dir():
            raise FolderError(
                f"model_index.json lists component {name!r} ({spec.library}.{spec.class_name}) but the folder "
                f"{str(subfolder)!r} is missing; restore it, or pass {name}=... to from_pretrained."
            )
        sources[name] = ComponentSource(name=name, cls=cls, family=family_of(cls), folder=subfolder)
    return sources


def _check_not_a_loop(subfolder: Path, folder: Path, name: str) -> None:
    """A component subfolder linked to itself cannot be read, and one linked to the pipeline folder (or a folder
    above it) would be read as a component: both are named here, not reported as a missing folder."""
    if not subfolder.is_symlink():
        return
    if _is_loop(subfolder):
        where = "itself (a symlink loop)"
    else:
        target, root = subfolder.resolve(), folder.resolve()
        if target != root and target not in root.parents:
            return
        where = f"{str(target)!r}: the pipeline folder or a folder above it"
    raise FolderError(
        f"Component {name!r}: its folder {str(subfolder)!r} is a symlink to {where}, so it holds no component. "
        f"Point the link at the component's own folder (or restore that folder), or pass {name}=... to "
        "from_pretrained."
    )


def _is_loop(path: Path) -> bool:
    try:
        path.stat()
    except OSError as error:
        return error.errno == errno.ELOOP
    except RuntimeError:
        return True
    return False


def _check_subfolder_name(name: str) -> None:
    """A component name is a subfolder of the pipeline folder: never a path that leaves it."""
    if name in (".", "..") or "/" in name or "\\" in name or Path(name).is_absolute():
        raise FolderError(
            f"model_index.json names component {name!r}, which is not a plain folder name; component names may "
            "not contain '/', '\\' or be '..'. Fix model_index.json."
        )


def load_non_module(source: ComponentSource) -> Any:
    """A tokenizer/scheduler/...: ours must load; a diffusers/transformers one that fails is reported and skipped."""
    if not callable(getattr(source.cls, "from_pretrained", None)):
        raise FolderError(
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


def model_folder_class(folder: Path) -> type:
    """The class a single model's folder holds, from its config.json: a diffusers model (`_class_name`, written
    with `_diffusers_version`), a transformers model (`architectures`) or one of this library's (`_class_name`),
    resolved as a pipeline's components are (nothing a folder names is imported)."""
    config = read_config_dict(folder)
    class_name = config.get(CLASS_NAME_KEY)
    architectures = config.get("architectures") or []
    if isinstance(class_name, str) and find_library_class(class_name) is not None and "_diffusers_version" not in config:
        spec = ComponentSpec(library=LIBRARY, class_name=class_name)
    elif isinstance(class_name, str):
        spec = ComponentSpec(library="diffusers", class_name=class_name)
    elif architectures and isinstance(architectures[0], str):
        spec = ComponentSpec(library="transformers", class_name=architectures[0])
    else:
        raise FolderError(
            f"{folder / CONFIG_NAME} names no model class (no '_class_name' as diffusers and this library write, no "
            "'architectures' as transformers writes); load it with its own class's from_pretrained."
        )
    return resolve_class(spec, component=folder.name)


def foreign_model_folder(folder: Path, cls: type) -> str | None:
    """Which library saved `folder`, when it is not `cls`'s (a diffusers or transformers model folder given to
    a `pipelines.ModelMixin`): "diffusers UNet2DConditionModel"; None when it is ours."""
    try:
        config = read_config_dict(folder)
    except FolderError:
        return None
    if "_diffusers_version" in config:
        return f"diffusers {config.get(CLASS_NAME_KEY)}"
    if "transformers_version" in config or "architectures" in config:
        return f"transformers {(config.get('architectures') or ['?'])[0]}"
    return None
