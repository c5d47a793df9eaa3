"""The Python snippets of README.md and docs/memory.md run as written (each document's blocks in order, in one
fresh process, in an empty folder), so the docs cannot drift from the code. A block fenced ```python no-run
(it needs the Hub, a GPU or torchrun) is left out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def snippets(document: str) -> str:
    return "\n".join(BLOCK.findall((ROOT / document).read_text()))


@pytest.mark.parametrize("document", ["README.md", "docs/memory.md"])
def test_snippets_run(document, tmp_path):
    code = snippets(document)
    assert code.strip(), f"{document} has no python snippet"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
