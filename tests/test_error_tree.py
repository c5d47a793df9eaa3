"""The error tree (issue 17): every error of the three packages derives from PlacementError through one of a few
mid-level bases, one per stage, so that `except PlanError` / `except LoadError` mean something. The concrete
errors keep their ValueError / RuntimeError bases beside them (tests/pipelines/test_errors.py checks those)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from hooks.errors import PlacementRuntimeError
from pipelines.errors import CallError, DeviceMappedError, FolderError, LoadError
from placement.errors import PlacementError, PlanError

ROOT = Path(__file__).resolve().parents[1]
MID_LEVEL = (PlanError, PlacementRuntimeError, FolderError, LoadError, CallError, DeviceMappedError)


def defined_errors() -> dict[str, type]:
    found = {}
    for package in ("placement", "hooks", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            for name, value in vars(module).items():
                if inspect.isclass(value) and issubclass(value, PlacementError) and value.__module__ == module.__name__:
                    found[f"{module.__name__}.{name}"] = value
    return found


def test_every_error_sits_under_one_mid_level_base():
    errors = defined_errors()
    assert len(errors) > 50  # the walk found the errors (a vacuous pass would find none)
    stray = sorted(name for name, cls in errors.items()
                   if cls is not PlacementError and cls not in MID_LEVEL and not issubclass(cls, MID_LEVEL))
    assert stray == [], f"derive these from one of {[base.__name__ for base in MID_LEVEL]}: {stray}"


def test_direct_children_of_the_root_are_the_mid_level_bases_only():
    errors = defined_errors().values()
    direct = {cls.__name__ for cls in errors if PlacementError in cls.__bases__}
    assert direct == {base.__name__ for base in MID_LEVEL}
