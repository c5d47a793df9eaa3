"""Every error of `pipelines` is importable from the package face, and sits under the stage base where it
belongs, with the builtin base (ValueError, RuntimeError, TypeError, FileNotFoundError) its callers catch."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import pipelines
from hooks.errors import OffloadConflictError
from pipelines.errors import CallError, FolderError, LoadError
from placement.errors import PlacementError

ROOT = Path(pipelines.__file__).resolve().parent


def defined_errors() -> dict[str, type]:
    """Every PlacementError subclass defined in a module of `pipelines`, by name. The command's own errors
    (`pipelines/cli/`) are left out: the command prints them as one line and no Python caller sees them, and the
    face sits below `cli` (tests/test_layering.py), so it may not import them."""
    found = {}
    paths = (p for p in ROOT.rglob("*.py") if p.name != "__main__.py" and "cli" not in p.relative_to(ROOT).parts[:1])
    for path in sorted(paths):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, PlacementError) and value.__module__ == module.__name__:
                found[name] = value
    return found


def test_every_error_is_exported_by_the_package_face():
    errors = defined_errors()
    assert len(errors) >= 10
    missing = sorted(name for name, cls in errors.items() if getattr(pipelines, name, None) is not cls)
    assert missing == [], f"add {missing} to the __all__ of pipelines.errors"
    assert set(errors) <= set(pipelines.__all__) and set(errors) <= set(dir(pipelines))


@pytest.mark.parametrize(
    ("name", "bases"),
    [
        ("FolderError", (PlacementError, ValueError)),
        ("WeightsNotFoundError", (FolderError, ValueError, FileNotFoundError)),
        ("CheckpointShapeError", (FolderError, ValueError)),
        ("CheckpointSaveError", (FolderError, RuntimeError)),
        ("UntrustedClassError", (FolderError, ValueError)),
        ("FolderChangedError", (FolderError, RuntimeError)),
        ("LoadError", (PlacementError, ValueError)),
        ("UnknownKeywordError", (LoadError, ValueError, TypeError)),
        ("CallSpecError", (LoadError, ValueError)),
        ("MissingComponentsError", (LoadError, ValueError)),
        ("PipelineLoadError", (LoadError, RuntimeError)),
        ("ReplicaLoadError", (LoadError, RuntimeError)),
        ("CallError", (PlacementError, ValueError)),
        ("ImageRunError", (CallError, RuntimeError)),
    ],
)
def test_errors_sit_under_their_stage_base_and_keep_their_builtin_one(name, bases):
    assert all(issubclass(getattr(pipelines, name), base) for base in bases)


def test_the_stage_bases_are_placement_errors_and_distinct():
    bases = (FolderError, LoadError, CallError)
    assert all(issubclass(base, PlacementError) for base in bases)
    assert not any(issubclass(a, b) for a in bases for b in bases if a is not b)
    assert not issubclass(OffloadConflictError, bases)
