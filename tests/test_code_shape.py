"""Files and functions stay small enough to read at once (the project's style: <= 600 lines, <= 80 lines; cut
along seams, not to fit these numbers)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("package", ["placement", "hooks", "pipelines"])
def test_no_file_over_600_lines_and_no_function_over_80(package):
    long_files = {
        str(path.relative_to(ROOT)): n for path in _sources(package)
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    functions = {str(path.relative_to(ROOT)): found for path in _sources(package) if (found := long_functions(path))}
    assert long_files == {} and functions == {}, f"too long: files {long_files}, functions {functions}"


def test_the_check_measures_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
