"""From a pipeline folder (local, or a Hub id downloaded with only the files a load needs) to its components:
each one's class, family (families.py: how it is built, read and saved) and subfolder."""

from __future__ import annotations

import errno
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import huggingface_hub
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from ..checkpoint.files import CLASS_NAME_KEY, CONFIG_NAME, read_config_dict
from ..checkpoint.index import is_plain_file_name
from ..checkpoint import WeightsNotFoundError
from ..errors import FolderError
from .class_registry import LIBRARY, find_library_class, find_registered_named
from .families import Family, ModelFamily, family_of  # noqa: F401 (Family: the families by name, for callers)
from .model_index import ComponentSpec, ModelIndex, resolve_class
from .paths import looks_like_a_path


@dataclass(frozen=True, kw_only=True)
class HubOptions:
    """diffusers' download keywords for `snapshot_download`, part of every load request, never carried implicitly."""

    revision: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False


def resolve_folder(name_or_path: str | Path, *, allow_patterns: Sequence[str] | None = None,
                   subfolder: str | None = None, hub: HubOptions = HubOptions()) -> Path:
    """The local folder of `name_or_path` (joined with `subfolder`): an existing path untouched, else a Hub id
    fetched with `snapshot_download`, limited to `allow_patterns` (relative to the repository root)."""
    local = Path(name_or_path).expanduser()
    if local.exists():
        return _with_subfolder(local, subfolder)
    repo_id = str(name_or_path)
    if isinstance(name_or_path, os.PathLike) or looks_like_a_path(repo_id) or not _is_repo_id(repo_id):
        raise WeightsNotFoundError(
            f"No such folder: {repo_id!r} (looked for {str(local.absolute())!r}). Check the path; a Hugging Face "
            "Hub id is written owner/name."
        )
    given = {"token": hub.token, "cache_dir": hub.cache_dir, "local_files_only": hub.local_files_only}
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=list(allow_patterns) if allow_patterns is not None else None,
            revision=hub.revision, **{key: value for key, value in given.items() if value},
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise WeightsNotFoundError(
            f"{repo_id!r} is not an existing folder (looked for {str(local.absolute())!r}), and fetching it as a "
            f"Hugging Face Hub id failed ({type(error).__name__}: {str(error).splitlines()[0]}). Check the path; "
            "for a Hub id, check its spelling, your network, and HF_TOKEN for gated or private repositories."
        ) from error
    return _with_subfolder(Path(snapshot), subfolder)


def _is_repo_id(text: str) -> bool:
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _with_subfolder(folder: Path, subfolder: str | None) -> Path:
    path = folder / subfolder if subfolder else folder
    if not path.is_dir():
        raise WeightsNotFoundError(f"Folder {str(path)!r} does not exist (subfolder={subfolder!r}).")
    return path


# What a pipeline folder needs for planning (configs) and, in addition, for loading (weights).
PLAN_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model"]
LOAD_PATTERNS = PLAN_PATTERNS + ["*/*.safetensors"]
PICKLE_PATTERNS = ["*/*.bin", "*/*.bin.index.json"]  # fetched only on the explicit opt-in (use_safetensors=False)


@dataclass(frozen=True, kw_only=True)
class ComponentSource:
    """One saved component: its name, class, family (how it is built) and subfolder."""

    name: str
    cls: type
    family: ModelFamily
    folder: Path

    @property
    def is_module(self) -> bool:
        return self.family.is_module


def resolve_pipeline_folder(pretrained: str | Path, *, weights: bool, hub: HubOptions = HubOptions()) -> Path:
    return resolve_folder(pretrained, allow_patterns=LOAD_PATTERNS if weights else PLAN_PATTERNS, hub=hub)


def component_sources(index: ModelIndex, folder: Path, *, skip: Mapping[str, Any],
                      trust_remote_code: bool = False) -> dict[str, ComponentSource]:
    """Every present component the folder provides, less those in `skip` (passed by the caller). Every class is
    resolved before any is built: an untrusted class fails before any work."""
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
    """A component subfolder linked to itself, or to the pipeline folder or above, holds no component: said so."""
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
    if not is_plain_file_name(name):
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
    """The class a single model's folder holds, from its config.json, resolved as a pipeline's components are."""
    config = read_config_dict(folder)
    class_name = config.get(CLASS_NAME_KEY)
    architectures = config.get("architectures") or []
    registered = find_registered_named(class_name) if isinstance(class_name, str) else None
    if registered is not None:  # a user's model class (diffusers writes its name without its module)
        return registered
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
    """"diffusers UNet2DConditionModel" when `folder` was saved by another library than ours; None when ours."""
    try:
        config = read_config_dict(folder)
    except FolderError:
        return None
    if "_diffusers_version" in config:
        return f"diffusers {config.get(CLASS_NAME_KEY)}"
    if "transformers_version" in config or "architectures" in config:
        return f"transformers {(config.get('architectures') or ['?'])[0]}"
    return None
