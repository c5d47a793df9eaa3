"""model_index.json: which class each component of a saved pipeline is, and how to import it again.

The file is diffusers-compatible: `{"_class_name": "TextToImagePipeline", "vae": ["pipelines", "AutoencoderKL"],
"text_encoder_2": [null, null], ...}`. Keys starting with "_" are metadata; every other key is a component
whose value is `[library, ClassName]`. `library` is "pipelines" (this package), "diffusers"/"transformers"
(the `[hf]` extra), or for a user's own class its importable module path (`cls.__module__`). `[null, null]`
marks an optional component that is absent. We add `_model_graph` (the pipeline's edges) so that a generic
`Pipeline.from_pretrained` can order any folder we wrote; diffusers ignores unknown "_" keys.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from placement.errors import PlacementError

from .registry import LIBRARY, find_library_class, is_library_class

MODEL_INDEX_NAME = "model_index.json"
HF_LIBRARIES = ("diffusers", "transformers")


class ModelIndexError(PlacementError, ValueError):
    """A model_index.json that is missing, malformed, or names a class that cannot be imported."""


class ComponentSpec(BaseModel):
    """One component entry: the library it comes from and its class name (both None when absent)."""

    model_config = ConfigDict(frozen=True)

    library: str | None
    class_name: str | None

    @property
    def is_absent(self) -> bool:
        return self.library is None or self.class_name is None

    def to_json_value(self) -> list[str | None]:
        return [self.library, self.class_name]


class ModelIndex(BaseModel):
    """The parsed model_index.json. `components` keeps the file's order (it is the generic load order)."""

    model_config = ConfigDict(frozen=True)

    class_name: str
    components: dict[str, ComponentSpec]
    model_graph: list[tuple[str, str]] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)  # "_" keys and non-component settings, kept as read

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = MODEL_INDEX_NAME) -> "ModelIndex":
        if "_class_name" not in data:
            raise ModelIndexError(f"{source} has no '_class_name'; a pipeline folder's index must name its class.")
        components, settings = {}, {}
        for name, value in data.items():
            if name.startswith("_"):
                continue
            if not isinstance(value, (list, tuple)):
                settings[name] = value  # a pipeline setting diffusers keeps here (requires_safety_checker, ...)
                continue
            if len(value) != 2:
                raise ModelIndexError(
                    f"{source}: component {name!r} is {value!r}; expected [library, ClassName] "
                    "(or [null, null] for an absent optional component)."
                )
            components[name] = ComponentSpec(library=value[0], class_name=value[1])
        graph = data.get("_model_graph")
        metadata = {k: v for k, v in data.items() if k.startswith("_") and k not in ("_class_name", "_model_graph")}
        metadata.update(settings)
        return cls(
            class_name=data["_class_name"],
            components=components,
            model_graph=[tuple(edge) for edge in graph] if graph is not None else None,
            metadata=metadata,
        )

    @classmethod
    def read(cls, folder: str | Path) -> "ModelIndex":
        path = Path(folder) / MODEL_INDEX_NAME
        if not path.is_file():
            raise ModelIndexError(
                f"{path} not found: a pipeline folder needs a {MODEL_INDEX_NAME} (write one with "
                "pipe.save_pretrained(folder)); for a single model use ModelMixin.from_pretrained."
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ModelIndexError(f"{path} is not valid JSON: {error}") from error
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"_class_name": self.class_name, **self.metadata}
        if self.model_graph is not None:
            data["_model_graph"] = [list(edge) for edge in self.model_graph]
        data.update({name: spec.to_json_value() for name, spec in self.components.items()})
        return data

    def write(self, folder: str | Path) -> None:
        (Path(folder) / MODEL_INDEX_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def spec_for(obj: Any) -> ComponentSpec:
    """The `[library, ClassName]` entry that will import `obj`'s class again (None -> [null, null])."""
    if obj is None:
        return ComponentSpec(library=None, class_name=None)
    cls = type(obj)
    top_level = cls.__module__.split(".")[0]
    if top_level in HF_LIBRARIES:
        return ComponentSpec(library=top_level, class_name=cls.__name__)
    if is_library_class(cls):
        return ComponentSpec(library=LIBRARY, class_name=cls.__name__)
    if cls.__module__ == "__main__":
        raise ModelIndexError(
            f"{cls.__name__} is defined in __main__, so a saved folder could not import it again; "
            "move the class into an importable module."
        )
    return ComponentSpec(library=cls.__module__, class_name=cls.__name__)


def resolve_class(spec: ComponentSpec, *, component: str) -> type:
    """Import the class of a component entry; a clear error when the library or class is unknown."""
    library, class_name = spec.library, spec.class_name
    if library == LIBRARY:
        found = find_library_class(class_name)
        if found is None:
            raise ModelIndexError(
                f"Component {component!r}: class {class_name!r} is not part of the 'pipelines' library; "
                "check model_index.json or import the module that defines it under its own module path."
            )
        return found
    try:
        module = importlib.import_module(library)
    except ImportError as error:
        hint = (
            " Install the [hf] extra: pip install 'pipeline-placement[hf]'."
            if library in HF_LIBRARIES
            else " The library must be 'pipelines', 'diffusers', 'transformers' or an importable module path: "
            f"install the package that defines {library!r}, or add its folder to PYTHONPATH (the `placement` "
            "command does not look in the current folder)."
        )
        raise ModelIndexError(f"Component {component!r}: cannot import library {library!r} ({error}).{hint}") from error
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise ModelIndexError(
            f"Component {component!r}: {library!r} has no class {class_name!r}; check model_index.json."
        )
    return found
