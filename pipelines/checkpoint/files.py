"""The checkpoint folder's file names, exactly as diffusers and transformers write them (a variant goes before
the last suffix, as `diffusers.utils._add_variant` puts it), and its JSON config files: one writer and one
reader, `_class_name` and other "_" keys as bookkeeping beside the pydantic fields, every failure naming the
file and the field."""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import FolderError, WeightsNotFoundError


DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model"
TRANSFORMERS_WEIGHTS_NAME = "model"
CONFIG_NAME = "config.json"
SAFETENSORS = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_VARIANT = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True, kw_only=True)
class WeightsNaming:
    """The names of one model's weight files for one variant (None: the unsuffixed weights)."""

    weights_name: str = DIFFUSERS_WEIGHTS_NAME
    variant: str | None = None

    def __post_init__(self):
        if self.variant is not None and not _VARIANT.match(self.variant):
            raise ValueError(
                f"Invalid variant {self.variant!r}: use letters, digits and '_' only (e.g. 'fp16'), "
                "because the variant becomes part of the file names."
            )

    @property
    def _stem(self) -> str:
        return self.weights_name if self.variant is None else f"{self.weights_name}.{self.variant}"

    @property
    def single_file(self) -> str:
        return f"{self._stem}{SAFETENSORS}"

    @property
    def index_file(self) -> str:
        suffix = "" if self.variant is None else f".{self.variant}"
        return f"{self.weights_name}{SAFETENSORS}.index{suffix}.json"

    @property
    def shard_pattern(self) -> str:
        """The `filename_pattern` of `huggingface_hub.split_torch_state_dict_into_shards`."""
        return f"{self._stem}{{suffix}}{SAFETENSORS}"

    def shard_file(self, number: int, total: int) -> str:
        return f"{self._stem}-{number:05d}-of-{total:05d}{SAFETENSORS}"

    def owns(self, filename: str) -> bool:
        """Whether a save of this naming writes (and so may replace) `filename`."""
        if filename in (self.single_file, self.index_file):
            return True
        shard = re.fullmatch(re.escape(self._stem) + r"-\d{5}-of-\d{5}" + re.escape(SAFETENSORS), filename)
        return shard is not None

    def allow_patterns(self, subfolder: str | None = None) -> list[str]:
        """`snapshot_download` patterns that fetch exactly this model's config and weights."""
        names = [CONFIG_NAME, self.single_file, self.index_file, f"{self._stem}-*-of-*{SAFETENSORS}"]
        return [f"{subfolder.strip('/')}/{n}" if subfolder else n for n in names]


def variants_in(folder: Path, weights_name: str) -> list[str]:
    """The variants with safetensors weights in `folder`, "default" standing for the unsuffixed ones."""
    stem = re.escape(weights_name)
    weights = re.compile(rf"^{stem}(?:\.(?P<variant>[A-Za-z0-9_]+))?(?:-\d{{5}}-of-\d{{5}})?\.safetensors$")
    index = re.compile(rf"^{stem}\.safetensors\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$")
    found = set()
    for path in folder.iterdir() if folder.is_dir() else ():
        match = weights.match(path.name) or index.match(path.name)
        if match:
            found.add(match.group("variant") or "default")
    return sorted(found)


# The stems of pickle weights, per safetensors stem: transformers writes `pytorch_model.bin` beside `model.safetensors`.
_PICKLE_STEMS = {TRANSFORMERS_WEIGHTS_NAME: (TRANSFORMERS_WEIGHTS_NAME, "pytorch_model")}


def pickle_files_in(folder: Path, weights_name: str) -> list[str]:
    """Pickle weights (never unpickled here), so that the error can say they are there."""
    if not folder.is_dir():
        return []
    stems = _PICKLE_STEMS.get(weights_name, (weights_name,))
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(stems) and p.suffix in PICKLE_SUFFIXES)


CLASS_NAME_KEY = "_class_name"
Config = TypeVar("Config", bound=BaseModel)
# Real configs nest 3 to 10 levels; thousands would exhaust the stack (a raw RecursionError) in whatever walks them.
MAX_JSON_DEPTH = 64


def write_config(folder: str | Path, config: BaseModel, *, class_name: str, file_name: str = CONFIG_NAME) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    content = {CLASS_NAME_KEY: class_name, **config.model_dump(mode="json")}
    return write_json(folder / file_name, content)


def write_json(path: Path, content: Any, *, sort_keys: bool = True) -> Path:
    """Written to a temporary sibling and renamed: never half a file, and a file hard-linked from an earlier save
    is never modified."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        temporary.write_text(json.dumps(content, indent=2, sort_keys=sort_keys) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


IDENTITY_FIELDS = ("st_dev", "st_ino", "st_size", "st_mtime_ns")


def file_identity(path: str | Path) -> dict[str, int]:
    """What tells one version of a file from another: a save over it (a new file renamed into place) changes the
    inode, a write into it the size or modification time. A symlink (the Hugging Face cache) is followed."""
    status = os.stat(path)
    return {field: getattr(status, field) for field in IDENTITY_FIELDS}


def read_config_dict(folder: str | Path, file_name: str = CONFIG_NAME) -> dict[str, Any]:
    path = Path(folder) / file_name
    if not path.is_file():
        raise WeightsNotFoundError(
            f"No {file_name} in {str(Path(folder))!r}: this is not a saved folder of that kind; save it there with "
            "save_pretrained(folder) first."
        )
    try:
        content = parse_json(path.read_text(encoding="utf-8"), path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FolderError(f"{str(path)!r} is not valid JSON ({error}).") from error
    except OSError as error:
        raise FolderError(f"Cannot read {str(path)!r}: {error}.") from error
    if not isinstance(content, dict):
        raise FolderError(f"{str(path)!r} must hold a JSON object, got {type(content).__name__}.")
    return content


def parse_json(text: str, path: Path) -> Any:
    """`json.loads(text)`, refusing a document nested deeper than `MAX_JSON_DEPTH` (naming `path`)."""
    try:
        content = json.loads(text)
        too_deep = json_depth(content) > MAX_JSON_DEPTH
    except RecursionError:  # the reader itself ran out of stack (about 1000 levels)
        too_deep = True
    if too_deep:
        raise FolderError(
            f"{str(path)!r} nests its JSON more than {MAX_JSON_DEPTH} levels deep, the limit (real configs nest "
            "under 10). The file is damaged or not a config: restore it from the original save or download."
        )
    return content


def json_depth(content: Any) -> int:
    """How deep `content` nests objects and arrays; walked without recursion."""
    deepest, stack = 0, [(content, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # past the limit the answer is known: stop descending
            stack.extend((child, depth + 1) for child in children)
    return deepest


def read_config(folder: str | Path, config_class: type[Config], *, file_name: str = CONFIG_NAME,
                subfolder: str | None = None) -> Config:
    """`config_class` validated from the config file; an unknown, missing or ill-typed field is named."""
    folder = Path(folder) / subfolder if subfolder else Path(folder)
    content = read_config_dict(folder, file_name)
    fields = {key: value for key, value in content.items() if not key.startswith("_")}
    try:
        return config_class.model_validate(fields)
    except ValidationError as error:
        raise FolderError(
            f"{str(folder / file_name)!r} does not validate as {config_class.__name__}: "
            f"{describe_validation_error(error)}. Fix or remove these fields."
        ) from error


def describe_validation_error(error: ValidationError) -> str:
    """"field 'shift': Input should be greater than 0 (got -1)" per problem, joined by "; "."""
    problems = []
    for problem in error.errors():
        field = ".".join(str(part) for part in problem.get("loc", ())) or "<root>"
        if problem.get("type") == "extra_forbidden":
            problems.append(f"unknown field {field!r}")
        else:
            problems.append(f"field {field!r}: {problem.get('msg')} (got {problem.get('input')!r})")
    return "; ".join(problems)
