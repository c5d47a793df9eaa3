"""The error tree: every error of the three packages derives from PlacementError through one base per stage, so
that `except PlanError` / `except LoadError` mean something; below those, a type exists only where a caller
catches it (the message says the rest), so there are few. The builtin bases (ValueError, RuntimeError, ...) are
checked in tests/pipelines/test_errors.py."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from hooks.errors import PlacementRuntimeError
from pipelines.errors import CallError, FolderError, LoadError
from placement.errors import PlacementError, PlanError

ROOT = Path(__file__).resolve().parents[1]
MID_LEVEL = (PlanError, PlacementRuntimeError, FolderError, LoadError, CallError)
MOST_TYPES = 25  # exceptions and warnings together, in the three packages


def defined_errors(root: type = PlacementError) -> dict[str, type]:
    found = {}
    for package in ("placement", "hooks", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            for name, value in vars(module).items():
                if inspect.isclass(value) and issubclass(value, root) and value.__module__ == module.__name__:
                    found[f"{module.__name__}.{name}"] = value
    return found


def test_every_error_sits_under_one_mid_level_base():
    errors = defined_errors()
    assert len(errors) >= 15  # the walk found the errors (a vacuous pass would find none)
    stray = sorted(name for name, cls in errors.items()
                   if cls is not PlacementError and cls not in MID_LEVEL and not issubclass(cls, MID_LEVEL))
    assert stray == [], f"derive these from one of {[base.__name__ for base in MID_LEVEL]}: {stray}"


def test_direct_children_of_the_root_are_the_mid_level_bases_only():
    errors = defined_errors().values()
    direct = {cls.__name__ for cls in errors if PlacementError in cls.__bases__}
    assert direct == {base.__name__ for base in MID_LEVEL}


def test_few_types_each_a_stage_base_or_one_that_callers_catch():
    """Exceptions and warnings (e.g. ZeroBudgetWarning, which users filter) together."""
    found = defined_errors(BaseException)
    assert len(found) <= MOST_TYPES, sorted(found)
