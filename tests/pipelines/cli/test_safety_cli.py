"""The `placement` command never prints a traceback unless asked: one line, exit 2 for bad input, 1 otherwise."""

from __future__ import annotations

import json

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

