"""No import cycles between the files of a package, deferred (function-level) imports included.

A cycle hidden behind an import inside a function still couples the two files both ways: neither can be read,
tested or moved alone. Imports under `if TYPE_CHECKING:` never run and are not counted there; they still tie files
together for a reader, so the type-level circle around the Plan is measured with them and held small, and the cost
formula is held a leaf.
"""

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool = False):
    """Every Import/ImportFrom node, skipping `if TYPE_CHECKING:` bodies unless `type_checking`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            yield from (n for child in node.orelse for n in _imports_in(child, type_checking))
            continue
        yield from _imports_in(node, type_checking)


def _imports_in(node: ast.AST, type_checking: bool):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node, type_checking)


def imported_modules(path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The modules of `known` that `path` imports: `from a.b import c` counts a.b.c when it is a module, else a.b."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), filename=str(path)), type_checking):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = package.split(".")
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {name for name in found if name in known and name != this}


def import_graph(package: str, type_checking: bool = False) -> nx.DiGraph:
    """`package`'s files and which import which (`type_checking`: imports under `if TYPE_CHECKING:` too)."""
    files = {module_name(path): path for path in (ROOT / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        for target in imported_modules(path, set(files), type_checking):
            # A package's __init__ re-exporting its own submodules is how packages are built, not a cycle.
            if not (path.name == "__init__.py" and target.startswith(f"{name}.")):
                graph.add_edge(name, target)
    return graph


@pytest.mark.parametrize(
    "package",
    [
        "placement",
        "hooks",
        "pipelines",
    ],
)
def test_no_import_cycles_between_files(package):
    cycles = sorted(sorted(cycle) for cycle in nx.simple_cycles(import_graph(package)))
    assert cycles == [], f"import cycles in {package}/: {cycles}"


def test_the_check_sees_a_cycle(tmp_path, monkeypatch):
    # Guard against a vacuous pass: a deferred import that closes a cycle is found.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import f\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert sorted(map(sorted, nx.simple_cycles(import_graph("pkg")))) == [["pkg.a", "pkg.b"]]


def largest_type_level_circle(package: str) -> set[str]:
    """The largest set of `package`'s files that all reach each other through imports, TYPE_CHECKING ones counted."""
    return max(nx.strongly_connected_components(import_graph(package, type_checking=True)), key=len)


def test_the_plans_type_level_circle_is_at_most_five_files():
    # The Plan's derived views (reports, drawings, seconds) take the Plan and the Plan calls them; its records live
    # in `plan_records`, which imports no logic, so nothing else joins that circle (11 files before issue 40).
    circle = largest_type_level_circle("placement")
    assert "placement.plan_schema" in circle and len(circle) <= 5, sorted(circle)
    assert "placement.plan_records" not in circle and "placement.cost" not in circle


def test_cost_is_a_leaf():
    # The one cost formula is read by the Plan's records, the search and the streaming layout; it imports none of
    # them, not even for types, only leaf modules (devices, errors and the assumed rates).
    graph = import_graph("placement", type_checking=True)
    leaves = {"placement.devices", "placement.errors", "placement.rates"}
    assert set(graph.successors("placement.cost")) <= leaves
    assert nx.descendants(graph, "placement.cost") == leaves | nx.descendants(graph, "placement.devices")
    assert "placement.cost" not in nx.descendants(graph, "placement.devices")


def test_the_type_level_measure_sees_a_type_checking_circle(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import f\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(nx.simple_cycles(import_graph("pkg"))) == []
    assert largest_type_level_circle("pkg") == {"pkg.a", "pkg.b"}
