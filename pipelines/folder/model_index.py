"""model_index.json (diffusers-compatible): `[library, ClassName]` per component, `[null, null]` for an absent
one, "_" keys as metadata. We add `_model_graph` (so a generic load can order any folder we wrote) and
`_save_id`, fresh per save and written last. Classes resolve without importing what a folder names.

A load is a snapshot of one save: a save swaps the whole folder at once, but a load reads files at different
moments, so the folder's version (save id, folder and index identity) is read before and after the load, and a
load that straddled a save starts again."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from placement.errors import PlacementError

from ..checkpoint.files import read_config_dict, write_json
from ..errors import FolderChangedError, FolderError, UntrustedClassError
from .class_registry import LIBRARY, find_library_class, find_registered_class, is_library_class, register_class


MODEL_INDEX_NAME = "model_index.json"
SAVE_ID_KEY = "_save_id"
HF_LIBRARIES = ("diffusers", "transformers")


class ComponentSpec(BaseModel):
    """One component entry: its library and class name (both None when absent)."""

    model_config = ConfigDict(frozen=True)

    library: str | None
    class_name: str | None

    @property
    def is_absent(self) -> bool:
        return self.library is None or self.class_name is None

    def to_json_value(self) -> list[str | None]:
        return [self.library, self.class_name]


class ModelIndex(BaseModel):
    """The parsed model_index.json; `components` keeps the file's order (the generic load order)."""

    model_config = ConfigDict(frozen=True)

    class_name: str
    components: dict[str, ComponentSpec]
    model_graph: list[tuple[str, str]] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)  # "_" keys and non-component settings, kept as read

    @classmethod
    def from_dict(cls, data: Any, *, source: str = MODEL_INDEX_NAME) -> "ModelIndex":
        if not isinstance(data, dict):
            raise FolderError(f"{source} must hold a JSON object, got {type(data).__name__}.")
        class_name = data.get("_class_name")
        if not isinstance(class_name, str) or not class_name:
            raise FolderError(
                f"{source}: '_class_name' is {class_name!r}; a pipeline folder's index must name its class as a "
                'string, e.g. "_class_name": "TextToImagePipeline".'
            )
        components, settings = {}, {}
        for name, value in data.items():
            if name.startswith("_"):
                continue
            if not isinstance(value, (list, tuple)):
                settings[name] = value  # a pipeline setting diffusers keeps here (requires_safety_checker, ...)
                continue
            components[name] = _component_spec(name, value, source)
        metadata = {k: v for k, v in data.items() if k.startswith("_") and k not in ("_class_name", "_model_graph")}
        metadata.update(settings)
        return cls(class_name=class_name, components=components,
                   model_graph=_model_graph(data.get("_model_graph"), source), metadata=metadata)

    @property
    def save_id(self) -> str | None:
        value = self.metadata.get(SAVE_ID_KEY)
        return value if isinstance(value, str) else None

    @classmethod
    def read(cls, folder: str | Path) -> "ModelIndex":
        path = Path(folder) / MODEL_INDEX_NAME
        if not path.is_file():
            raise FolderError(
                f"{path} not found: a pipeline folder needs a {MODEL_INDEX_NAME} (write one with "
                "pipe.save_pretrained(folder)); for a single model use ModelMixin.from_pretrained."
            )
        data = read_config_dict(folder, MODEL_INDEX_NAME)  # the one JSON reader of the folder format
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"_class_name": self.class_name, **self.metadata}
        if self.model_graph is not None:
            data["_model_graph"] = [list(edge) for edge in self.model_graph]
        data.update({name: spec.to_json_value() for name, spec in self.components.items()})
        return data

    def write(self, folder: str | Path) -> None:
        write_json(Path(folder) / MODEL_INDEX_NAME, self.to_dict(), sort_keys=False)  # the order is the load order


def _component_spec(name: str, value: list | tuple, source: str) -> "ComponentSpec":
    valid = len(value) == 2 and (
        all(part is None for part in value) or all(isinstance(part, str) and part for part in value)
    )
    if not valid:
        raise FolderError(
            f"{source}: component {name!r} is {list(value)!r}; expected [library, ClassName] as two strings "
            '(e.g. ["pipelines", "AutoencoderKL"]), or [null, null] for an absent optional component.'
        )
    return ComponentSpec(library=value[0], class_name=value[1])


def _model_graph(graph: Any, source: str) -> list[tuple[str, str]] | None:
    if graph is None:
        return None
    edges = graph if isinstance(graph, list) else [graph]
    bad = [edge for edge in edges if not (isinstance(edge, (list, tuple)) and len(edge) == 2
                                          and all(isinstance(node, str) for node in edge))]
    if bad or not isinstance(graph, list):
        raise FolderError(
            f"{source}: '_model_graph' must be a list of [producer, consumer] component-name pairs, e.g. "
            f'[["text_encoder", "denoiser"], ["denoiser", "vae"]]; got {(bad or [graph])[0]!r}. Fix or remove it.'
        )
    return [tuple(edge) for edge in graph]


def spec_for(obj: Any) -> ComponentSpec:
    """The `[library, ClassName]` entry that imports `obj`'s class again (None -> [null, null])."""
    if obj is None:
        return ComponentSpec(library=None, class_name=None)
    cls = type(obj)
    top_level = cls.__module__.split(".")[0]
    pipeline_module = _diffusers_pipeline_dir(cls)
    if pipeline_module is not None:  # what diffusers writes for a class of a pipeline's own module
        return ComponentSpec(library=pipeline_module, class_name=cls.__name__)
    if top_level in HF_LIBRARIES:
        return ComponentSpec(library=top_level, class_name=cls.__name__)
    if is_library_class(cls):
        return ComponentSpec(library=LIBRARY, class_name=cls.__name__)
    if cls.__module__ == "__main__":
        raise FolderError(
            f"{cls.__name__} is defined in __main__, so a saved folder could not import it again; "
            "move the class into an importable module."
        )
    register_class(cls)  # the saving process may load what it saved without further ado
    return ComponentSpec(library=cls.__module__, class_name=cls.__name__)


def resolve_class(spec: ComponentSpec, *, component: str, trust_remote_code: bool = False,
                  known: tuple[type, ...] = ()) -> type:
    """The class of a component entry, found among this library's, diffusers', transformers', registered and `known`
    classes; any other module is imported only with `trust_remote_code=True`, because importing runs its code."""
    library, class_name = spec.library, spec.class_name
    if library == LIBRARY:
        found = find_library_class(class_name)
        if found is None:
            raise FolderError(
                f"Component {component!r}: class {class_name!r} is not part of the 'pipelines' library; "
                "check model_index.json, or register your class with pipelines.register_class."
            )
        return found
    if library.split(".")[0] in HF_LIBRARIES:  # their own (sub)modules: installed code the user already trusts
        return _class_in(_import_library(library, component), library, class_name, component)
    found = find_registered_class(library, class_name) or next(
        (cls for cls in known if (cls.__module__, cls.__name__) == (library, class_name)), None)
    if found is not None:
        return found
    pipeline_module = diffusers_pipeline_module(library)
    if pipeline_module is not None:  # diffusers' own code, read as diffusers' loader reads such an entry
        return _class_in(pipeline_module, f"diffusers.pipelines.{library}", class_name, component)
    if not trust_remote_code:
        raise UntrustedClassError(
            f"Component {component!r}: model_index.json names class {class_name!r} in module {library!r}, which is "
            "not this library's, diffusers', transformers' or a registered class; nothing was imported, because "
            "importing a module a folder names runs its code. If it is your class, import it and call "
            f"pipelines.register_class({class_name}) (or pass {component}=... to from_pretrained); if you trust "
            "this folder's code, pass trust_remote_code=True."
        )
    return _class_in(_import_library(library, component), library, class_name, component)


def diffusers_pipeline_module(library: str):
    """The `diffusers.pipelines` submodule named `library` (`"ltx2"`), or None. diffusers saves a class of a
    pipeline's own module (LTX-2's `connectors`, `LTX2TextConnectors` in diffusers/pipelines/ltx2/) as
    `[pipeline module, ClassName]` and its loader takes any library that is an attribute of `diffusers.pipelines`
    (`get_class_obj_and_candidates`); only a submodule diffusers ships is taken here, so a folder can name
    nothing but installed diffusers code."""
    if not library.isidentifier() or importlib.util.find_spec("diffusers") is None:
        return None
    import diffusers.pipelines

    try:
        found = getattr(diffusers.pipelines, library)  # diffusers' lazy module imports its own submodule
    except (AttributeError, ImportError, RuntimeError):  # RuntimeError: a submodule's missing optional backend
        return None
    return found if getattr(found, "__name__", None) == f"diffusers.pipelines.{library}" else None


def _diffusers_pipeline_dir(cls: type) -> str | None:
    """The library diffusers writes for `cls` when `cls` lives in a pipeline's own module (diffusers'
    `_fetch_class_library_tuple`: the module's parent package, when it is a `diffusers.pipelines` submodule)."""
    parts = cls.__module__.split(".")
    if len(parts) > 2 and parts[:2] == ["diffusers", "pipelines"] and diffusers_pipeline_module(parts[-2]):
        return parts[-2]
    return None


def _import_library(library: str, component: str):
    try:
        return importlib.import_module(library)
    except ImportError as error:
        hint = (
            " Install the [hf] extra: pip install 'pipeline-placement[hf]'."
            if library in HF_LIBRARIES
            else f" Install the package that defines {library!r}, or add its folder to PYTHONPATH."
        )
        raise FolderError(f"Component {component!r}: cannot import library {library!r} ({error}).{hint}") from error


def _class_in(module, library: str, class_name: str, component: str) -> type:
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise FolderError(
            f"Component {component!r}: {library!r} has no class {class_name!r}; check model_index.json."
        )
    return found


Result = TypeVar("Result")
ATTEMPTS = 5


def folder_version(folder: Path) -> tuple | None:
    """(save id, folder inode, index inode, index mtime) of the save in place at `folder`; None while missing."""
    index = folder / MODEL_INDEX_NAME
    try:
        folder_stat, index_stat = os.stat(folder), os.stat(index)
        content = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable now: the read itself says why
        return None
    save_id = content.get(SAVE_ID_KEY) if isinstance(content, dict) else None
    return (save_id if isinstance(save_id, str) else None, folder_stat.st_ino, index_stat.st_ino,
            index_stat.st_mtime_ns)


def read_snapshot(folder: Path, read: Callable[[], Result], *,
                  discard: Callable[[Result], object] = lambda result: None) -> Result:
    """`read()` retried until the folder's version is the same before and after it; an error raised while the
    folder changed is a symptom of the change and retried, one raised while it stood still is the answer."""
    for attempt in range(ATTEMPTS):
        before = folder_version(folder)
        try:
            result = read()
        except (PlacementError, OSError):
            if before is not None and folder_version(folder) == before:
                raise
            if attempt == ATTEMPTS - 1:
                raise
            _pause(attempt)
            continue
        if before is not None and folder_version(folder) == before:
            return result
        discard(result)
        _pause(attempt)
    raise FolderChangedError(
        f"{str(folder)!r} was saved over while it was being loaded, {ATTEMPTS} times in a row, so no load could "
        "read one save's components only. Load it when no other process is saving there, or load from a copy."
    )


def _pause(attempt: int) -> None:
    time.sleep(0.01 * 2**attempt)  # let the other save finish its swap
