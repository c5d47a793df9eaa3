"""pyproject.toml declares what the three packages import, and imports what it declares.

Every third-party module imported anywhere in placement/, hooks/ and pipelines/ (at the top of a module or
inside a function) belongs to a distribution named in `dependencies` or an optional extra; every runtime
dependency is imported somewhere. Module names map to distributions through the installed metadata
(`PIL` -> pillow), so a module installed only as part of another package's dependencies cannot pass unnoticed.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("placement", "hooks", "pipelines")


def imported_modules() -> dict[str, set[str]]:
    """{third-party top-level module: files importing it}."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module.split(".")[0]]
                else:
                    continue
                for name in names:
                    if name not in sys.stdlib_module_names and name not in PACKAGES:
                        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


def declared() -> tuple[set[str], set[str]]:
    """(runtime dependencies, optional ones) as normalized distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {requirement_name(r) for r in project["dependencies"]}
    optional = {requirement_name(r) for extra in project.get("optional-dependencies", {}).values() for r in extra}
    return runtime, optional


def distribution_of(module: str) -> str:
    return normalized(packages_distributions().get(module, [module])[0])


def test_every_imported_module_is_declared():
    runtime, optional = declared()
    undeclared = {module: sorted(files) for module, files in imported_modules().items()
                  if distribution_of(module) not in runtime | optional}
    assert undeclared == {}, f"imported but not in pyproject.toml's dependencies or extras: {undeclared}"


def test_every_runtime_dependency_is_imported():
    runtime, _ = declared()
    used = {distribution_of(module) for module in imported_modules()}
    assert runtime - used == set(), f"declared in pyproject.toml but imported nowhere: {sorted(runtime - used)}"


def test_the_scan_sees_optional_and_function_level_imports():
    found = imported_modules()
    assert "placement/budgets.py" in found["psutil"]  # imported inside a function
    assert distribution_of("PIL") == "pillow" and "diffusers" in found


def test_no_benchmark_or_test_helper_shadows_an_installed_module():
    """Tests put benchmarks/ and (pytest's prepend import mode) every test folder on sys.path; a file there named like an installed top-level
    module (benchmarks/optimum.py once did) hides it from every later import in the process: optimum-quanto's
    tests skipped with "'optimum' is not a package" in a whole run and passed alone."""
    installed = set(packages_distributions()) | set(sys.stdlib_module_names)
    folders = [ROOT / "benchmarks", ROOT / "tests", *(path for path in (ROOT / "tests").rglob("*") if path.is_dir())]
    shadowing = sorted(str(path.relative_to(ROOT)) for folder in folders for path in folder.glob("*.py")
                       if path.stem in installed)
    assert shadowing == [], f"rename these: they share a name with an installed or standard module: {shadowing}"


def lowest_script():
    """.ci/lowest.py, the constraints CI's lowest-versions stage installs with (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("ci_lowest", ROOT / ".ci" / "lowest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lowest_versions_run_pins_every_requirement_to_its_floor():
    """Adding a dependency or an extra cannot skip CI's second stage: each requirement of pyproject.toml is pinned
    to its `>=` floor (torch to the one build CI has), so a floor that stops installing or passing fails CI."""
    lowest = lowest_script()
    pyproject = (ROOT / "pyproject.toml").read_text()
    runtime, optional = declared()
    pinned = lowest.constraints(pyproject)
    assert set(pinned) == runtime | optional
    floors = {requirement_name(r): re.search(r">=\s*([^,;\s]+)", r).group(1) for r in lowest.requirements(pyproject)}
    assert pinned == {**floors, **lowest.KEPT}
    assert "peft" in pinned and "pytest" in pinned  # the extras are read, not only `dependencies`


def test_a_requirement_without_a_floor_is_refused_by_name():
    lowest = lowest_script()
    pyproject = '[project]\ndependencies = ["torch>=2.4"]\n[project.optional-dependencies]\nx = ["newpkg<2"]\n'
    with pytest.raises(lowest.FloorMissing, match=r"'newpkg<2' has 0 '>=' floors"):
        lowest.constraints(pyproject)
