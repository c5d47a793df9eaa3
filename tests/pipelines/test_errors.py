"""Every error of `pipelines` is importable from the package face, and sits under a mid-level base where it
belongs, keeping its ValueError/RuntimeError base so `except` clauses written before keep working."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import pipelines
from pipelines.errors import DeviceMappedError, FolderError, LoadError
from placement.errors import InvalidDeviceError, PlacementError

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
    assert len(errors) > 30
    missing = sorted(name for name, cls in errors.items() if getattr(pipelines, name, None) is not cls)
    assert missing == [], f"add {missing} to pipelines._ERRORS"


@pytest.mark.parametrize(
    ("name", "bases"),
    [
        ("WeightsNotFoundError", (FolderError, ValueError, FileNotFoundError)),
        ("CheckpointSaveError", (FolderError, RuntimeError)),
        ("ModelIndexError", (FolderError, ValueError)),
        ("UntrustedClassError", (FolderError, ValueError)),
        ("PipelineComponentError", (FolderError, ValueError)),
        ("FolderChangedError", (FolderError, RuntimeError)),
        ("PipelineSaveError", (FolderError, RuntimeError)),
        ("MissingConfigError", (FolderError, ValueError, FileNotFoundError)),
        ("PipelineLoadError", (LoadError, RuntimeError)),
        ("AcceleratorsMissingError", (LoadError, RuntimeError, InvalidDeviceError, ValueError)),
        ("LoadArgumentError", (LoadError, ValueError)),
        ("SavedPlanError", (LoadError, ValueError)),
        ("DiffusersPipelineError", (LoadError, ValueError)),
        ("CallSpecError", (LoadError, ValueError)),
        ("ReplicaLoadError", (LoadError, RuntimeError)),
        ("DeviceMappedError", (PlacementError, RuntimeError)),
    ],
)
def test_errors_sit_under_their_mid_level_base_and_keep_their_builtin_one(name, bases):
    assert issubclass(getattr(pipelines, name), bases)


def test_the_mid_level_bases_are_placement_errors_and_distinct():
    assert issubclass(FolderError, PlacementError) and issubclass(LoadError, PlacementError)
    assert not issubclass(FolderError, LoadError) and not issubclass(DeviceMappedError, (FolderError, LoadError))
