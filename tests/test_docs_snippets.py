"""The examples of README.md and docs/*.md run as written and print what the documents say they print.

Fences, by their info string:
- ```python            a snippet that runs as copied: alone, in a fresh process, in an empty folder;
- ```python continued  runs after the snippets before it in the same document (the text says which setup);
- ```python no-run     not run (it needs the Hub, a GPU or torchrun);
- ```output            what the python snippet just above prints (stdout), exactly; a line "..." stands for
                       any number of lines;
- ```console           `$ placement ...` commands, each followed by what it prints (stdout), "..." as above.

A listing that is not meant to run (an API summary, a sketch) is fenced ```python no-run.

Runs see a CPU-only machine (no CUDA, no virtual accelerators), so the outputs are the same everywhere the
tests run. After a change that alters an output, `python tests/test_docs_snippets.py --update` rewrites the
output blocks from what the examples print now (review the diff: it is what users will read).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from child_process import run_child

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[ \t]*([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
END_OF_BLOCK = "--- end of snippet ---"
ELLIPSIS = "..."


@dataclass(frozen=True, kw_only=True)
class Block:
    kind: str  # "python", "output", "console", "bash", ...
    option: str  # "", "continued", "no-run"
    text: str
    span: tuple[int, int]  # of the text, in the document


def blocks(document: str) -> list[Block]:
    content = (ROOT / document).read_text()
    return [Block(kind=m.group(1), option=m.group(2), text=m.group(3), span=m.span(3)) for m in FENCE.finditer(content)]


def chains(found: list[Block]) -> list[list[tuple[Block, Block | None]]]:
    """Runnable python snippets grouped by process (a plain one starts a chain, "continued" ones join it), each
    with the output block that follows it, if any."""
    grouped: list[list[tuple[Block, Block | None]]] = []
    for position, block in enumerate(found):
        if block.kind != "python" or block.option == "no-run":
            continue
        following = found[position + 1] if position + 1 < len(found) else None
        output = following if following is not None and following.kind == "output" else None
        if block.option == "continued" and grouped:
            grouped[-1].append((block, output))
        else:
            grouped.append([(block, output)])
    return grouped


def environment() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PLACEMENT_VIRTUAL_ACCELERATORS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", TQDM_DISABLE="1")
    return env


def run_chain(chain: list[tuple[Block, Block | None]]) -> list[str]:
    """Each snippet's stdout, running the chain in one fresh process in an empty folder."""
    code = f"\nprint({END_OF_BLOCK!r}, flush=True)\n".join(block.text for block, _ in chain)
    with tempfile.TemporaryDirectory() as folder:
        done = run_child([sys.executable, "-c", code], cwd=folder, env=environment())
    assert done.returncode == 0, done.stderr[-3000:]
    return [part.strip("\n") for part in done.stdout.split(END_OF_BLOCK + "\n")]


def console_commands(block: Block) -> list[tuple[str, str]]:
    """(command, expected output) for each `$ ` line of a console block."""
    found: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            found.append((line[2:], []))
        elif found:
            found[-1][1].append(line)
    return [(command, "\n".join(lines)) for command, lines in found]


def run_command(command: str) -> str:
    words = shlex.split(command)
    assert words[0] == "placement", f"console blocks run placement commands, not {command!r}"
    with tempfile.TemporaryDirectory() as folder:
        done = run_child([sys.executable, "-m", "pipelines.cli", *words[1:]], cwd=folder, env=environment())
    assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}"
    return done.stdout.strip("\n")


def matches(expected: str, actual: str) -> bool:
    """`actual` as `expected` says, trailing spaces aside, an ELLIPSIS line matching any lines."""
    pattern = "".join(r"(?:.*\n)*?" if line.strip() == ELLIPSIS else re.escape(line.rstrip()) + r"[ \t]*\n"
                      for line in expected.strip("\n").splitlines())
    return re.fullmatch(pattern, "\n".join(line.rstrip() for line in actual.splitlines()) + "\n") is not None


def updated(expected: str, actual: str) -> str:
    """`actual`, keeping an ELLIPSIS where `expected` had one: as many lines before and after it as there."""
    old, new = expected.strip("\n").splitlines(), actual.splitlines()
    if ELLIPSIS not in [line.strip() for line in old]:
        return actual
    cut = [line.strip() for line in old].index(ELLIPSIS)
    tail = len(old) - cut - 1
    return "\n".join([*new[:cut], ELLIPSIS, *(new[-tail:] if tail else [])])


def python_cases() -> list:
    return [pytest.param(document, index, id=f"{document}#{index}")
            for document in DOCUMENTS for index, _ in enumerate(chains(blocks(document)))]


def console_cases() -> list:
    return [pytest.param(document, command, expected, id=f"{document}: {command}")
            for document in DOCUMENTS for block in blocks(document) if block.kind == "console"
            for command, expected in console_commands(block)]


@pytest.mark.parametrize(("document", "index"), python_cases())
def test_python_examples_run_and_print_what_the_document_shows(document, index):
    chain = chains(blocks(document))[index]
    printed = run_chain(chain)
    for (block, output), actual in zip(chain, printed):
        if output is not None:
            assert matches(output.text, actual), f"{document}: the snippet\n{block.text}\nprints\n{actual}"


@pytest.mark.parametrize(("document", "command", "expected"), console_cases())
def test_console_examples_print_what_the_document_shows(document, command, expected):
    actual = run_command(command)
    assert matches(expected, actual), f"{document}: {command} prints\n{actual}"


def test_the_documents_have_examples_and_no_output_claims_left_in_comments():
    for document in ("README.md", "docs/memory.md"):
        assert any(block.kind == "python" for block in blocks(document)), f"{document} has no python snippet"
    for document in DOCUMENTS:
        found = blocks(document)
        assert all(block.option in ("", "continued", "no-run") for block in found), document
        for block in found:  # an output belongs in an output block, where the test compares it
            if block.kind == "python" and block.option != "no-run":
                claims = [line for line in block.text.splitlines() if re.search(r"print\(.*#\s*[{\['\"]", line)]
                assert not claims, f"{document}: output written in a comment, not in an output block: {claims}"


def test_the_documents_state_the_schema_version_plans_carry():
    """A number given for `schema_version` in README.md or docs/ is the one saved plans carry now."""
    from placement.plan_schema import SCHEMA_VERSION

    stated = {(document, int(number)) for document in DOCUMENTS
              for number in re.findall(r"schema_version`?\s*\(?(\d+)", (ROOT / document).read_text())}
    assert ("docs/memory.md", SCHEMA_VERSION) in stated  # the check reads what it polices
    assert {number for _, number in stated} == {SCHEMA_VERSION}, sorted(stated)


def update_documents() -> None:
    """Rewrite every output block (and console output) with what its example prints now."""
    for document in DOCUMENTS:
        content = (ROOT / document).read_text()
        replacements = []
        for chain in chains(blocks(document)):
            for (block, output), actual in zip(chain, run_chain(chain)):
                if output is not None:
                    replacements.append((output.span, updated(output.text, actual) + "\n"))
        for block in blocks(document):
            if block.kind == "console":
                text = "".join(f"$ {command}\n{updated(expected, run_command(command))}\n"
                               for command, expected in console_commands(block))
                replacements.append((block.span, text))
        for (start, end), text in sorted(replacements, reverse=True):
            content = content[:start] + text + content[end:]
        (ROOT / document).write_text(content)
        print(f"updated {document}")


if __name__ == "__main__":
    if "--update" in sys.argv:
        update_documents()


def test_ci_runs_the_readme_test_command_as_written():
    """.ci/run's first stage is the README's second command (install the extras, run the suite) verbatim, so CI
    tests what a user who copies it gets; its second stage installs the floors pyproject.toml states."""
    commands = [block.text.strip() for block in blocks("README.md") if block.kind == "bash"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pytest" in commands[1] and commands[1] in ci.splitlines()
    assert "python .ci/lowest.py" in ci and "set -euo pipefail" in ci
