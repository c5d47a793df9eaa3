"""Dependencies point one way (docs/design.md, "Layers"), between the packages and between the subpackages of
`pipelines`, deferred (function-level) imports and `importlib` calls with a literal name included.

Packages: pipelines -> hooks -> placement.
Inside `pipelines`, each layer may import only the layers after it in `PIPELINES_LAYERS`:

    cli -> distributed -> (the package face) -> presets -> text_to_image -> framework -> loading -> hf -> folder
        -> checkpoint -> errors

Why this order, following the data: `checkpoint` is the file format (it reads and writes tensors and config files,
knows nothing of pipelines, and imports no `hooks`); `folder` says what a saved folder is in terms of those files
(model_index.json, classes, Hub, snapshots, saving); `hf` describes diffusers/transformers classes and pipeline
folders in terms of our folder model; `loading` is the one loader built from all three (and `hooks`); `framework`
holds the user base classes whose entry points call the loader; `text_to_image` is a user of the framework; the
package face exports all of that lazily; `presets` writes the folders of the presets built from diffusers classes
(their configs are package data), which the commands then read as any folder; `distributed` and `cli` run pipelines and may look classes up by name on
the face. `errors` (pipelines/errors.py) is the middle of the error tree, below everything that raises.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"placement": {"hooks", "pipelines"}, "hooks": {"pipelines"}}
FACE = "<face>"  # pipelines/__init__.py: `import pipelines`, `from pipelines import X`
PIPELINES_LAYERS = ("cli", "distributed", FACE, "presets", "text_to_image", "framework", "loading", "hf", "folder",
                    "checkpoint", "errors")
NO_RUNTIME = {"checkpoint", "errors"}  # the file format imports no `hooks`


def imported_names(path: Path) -> set[str]:
    """Absolute names of every module `path` imports: top-level and deferred imports, relative ones resolved,
    and `importlib.import_module("literal")` calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update(f"{module}.{alias.name}" for alias in node.names)  # a submodule, or a name in `module`
            names.add(module)
        elif _is_import_module_call(node):
            names.add(node.args[0].value)
    return {name for name in names if name}


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__") and isinstance(node.args[0].value, str)


def pipelines_layer(module: str) -> str | None:
    """The layer of a `pipelines` module name (None outside `pipelines`)."""
    parts = module.split(".")
    if parts[0] != "pipelines":
        return None
    if len(parts) == 1 or parts[1] not in PIPELINES_LAYERS:
        return FACE  # `pipelines` itself, or a name it exports (`from pipelines import Pipeline`)
    return parts[1]


def file_layer(path: Path) -> str:
    relative = path.relative_to(ROOT / "pipelines")
    if relative == Path("__init__.py"):
        return FACE
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_higher_ones(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted({name.split(".")[0] for name in imported_names(path)} & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_every_file_of_pipelines_is_in_a_layer():
    layers = {file_layer(path) for path in (ROOT / "pipelines").rglob("*.py")}
    assert layers <= set(PIPELINES_LAYERS), f"add {sorted(layers - set(PIPELINES_LAYERS))} to PIPELINES_LAYERS"


def test_pipelines_subpackages_import_only_the_layers_below_them():
    rank = {layer: position for position, layer in enumerate(PIPELINES_LAYERS)}
    offenders = {}
    for path in sorted((ROOT / "pipelines").rglob("*.py")):
        layer = file_layer(path)
        upward = sorted(name for name in imported_names(path)
                        if (target := pipelines_layer(name)) is not None and rank[target] < rank[layer])
        if layer in NO_RUNTIME:
            upward += sorted(name for name in imported_names(path) if name.split(".")[0] == "hooks")
        if upward:
            offenders[str(path.relative_to(ROOT))] = upward
    assert offenders == {}, f"imports against the layer order {PIPELINES_LAYERS}: {offenders}"


def test_the_check_sees_imports(tmp_path, monkeypatch):
    # Guard against a vacuous pass: the scanner finds plain, relative, deferred and importlib imports.
    assert {"re", "__future__"} <= imported_names(ROOT / "placement" / "sizes.py")
    folder = tmp_path / "pipelines" / "folder"
    folder.mkdir(parents=True)
    source = "import importlib\nfrom ..loading import x\ndef f():\n    from pipelines import Pipeline\n" \
             "    importlib.import_module('pipelines.cli')\n"
    (folder / "m.py").write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    names = imported_names(folder / "m.py")
    assert {"pipelines.loading.x", "pipelines.Pipeline", "pipelines.cli"} <= names
    assert [pipelines_layer(n) for n in ("pipelines.loading.x", "pipelines.Pipeline", "pipelines.cli")] == [
        "loading", FACE, "cli"]
