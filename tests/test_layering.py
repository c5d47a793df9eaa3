"""Dependencies point one way: pipelines -> hooks -> placement (docs/design.md, "Layers")."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"placement": {"hooks", "pipelines"}, "hooks": {"pipelines"}}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_higher_ones(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_top_levels(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_the_check_sees_imports():
    # Guard against a vacuous pass: the scanner must find the imports of a file that has them.
    assert {"re", "__future__"} <= imported_top_levels(ROOT / "placement" / "sizes.py")
