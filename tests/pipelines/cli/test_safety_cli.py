"""The `placement` command never prints a traceback unless asked: one line, exit 2 for bad input, 1 otherwise."""

from __future__ import annotations

import errno
import json
import os

import pytest

from pipeline_fixtures import tiny_user_pipeline

from pipelines import cli
from pipelines.cli import plan as plan_command


def _broken_folder(tmp_path):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_model_graph"] = [["encoder"]]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert cli.main(["plan", str(_broken_folder(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "_model_graph" in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    folder = str(_broken_folder(tmp_path))
    assert cli.main(["plan", folder, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "FolderError" in err


def test_an_internal_error_is_exit_code_1_with_a_hint(tmp_path, capsys, monkeypatch):
    def crash(args):
        raise KeyError("oops")

    monkeypatch.setattr(plan_command, "run", crash)  # registered when main() builds its parser
    assert cli.main(["plan", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error (KeyError" in err and "--debug" in err


def test_an_unwritable_output_path_is_bad_input(tmp_path, capsys):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    blocked = folder / "model_index.json" / "plan.json"
    assert cli.main(["plan", str(folder), "--max-memory", "cpu=1GiB", "--json", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot access" in err



class _DiskFillsUp:
    """A file object that writes half of what it is given, then finds the disk full."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@pytest.mark.parametrize("flag", ["--json", "--svg", "--timeline"])
def test_a_full_disk_midway_keeps_the_previous_output_file_and_names_it(tmp_path, capsys, monkeypatch, flag):
    """`placement plan --json plan.json` on a full disk destroyed the previous plan.json, left a cut file and named
    no path: every file the CLI writes goes through a temporary sibling renamed into place."""
    target = tmp_path / "outputs" / "plan.out"
    command = ["plan", "tiny-flux", "--max-memory", "2x1GiB,cpu=2GiB", flag, str(target)]
    assert cli.main(command) == 0
    before = target.read_bytes()
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: _DiskFillsUp(real_fdopen(*args, **kwargs)))
    assert cli.main([*command[:-2], "--height", "64", "--width", "64", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert f"Cannot write {str(target)!r}: No space left on device (errno {errno.ENOSPC})" in err
    assert "unchanged" in err and "Traceback" not in err
    assert target.read_bytes() == before and [p.name for p in target.parent.iterdir()] == ["plan.out"]


def test_an_output_path_that_is_a_link_writes_the_file_it_names(tmp_path, capsys):
    """The user's own link: the file it names gets the plan (the link stays), written whole as any output."""
    real = tmp_path / "elsewhere" / "plan.json"
    real.parent.mkdir()
    real.write_text("old")
    (tmp_path / "plan.json").symlink_to(real)
    assert cli.main(["plan", "tiny-flux", "--max-memory", "2x1GiB,cpu=2GiB", "--json", str(tmp_path / "plan.json")]) == 0
    assert (tmp_path / "plan.json").is_symlink() and json.loads(real.read_text())["schema_version"]
