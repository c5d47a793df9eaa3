"""The `placement` console script as a user runs it: exit codes, no traceback, each warning once, messages in
flag names, and `--help` / argument errors without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from child_process import run_child

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(sys.executable).parent / "placement"


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def placement_command(*argv: str) -> subprocess.CompletedProcess:
    """The console script (as installed by `pip install -e .`), else `python -m pipelines.cli`."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "pipelines.cli"]
    return run_child([*command, *argv], env=env())


def test_help_and_argument_errors_do_not_import_torch():
    probe = """
import sys
from pipelines.cli import main
results = []
for argv in (["--help"], ["plan", "--help"], ["inspect", "--help"], ["demo", "--help"], ["plan"],
             ["plan", "tiny-flux", "--max-memory", "24GiB"], ["plan", "tiny-flux", "--dtype", "fp7"], ["bogus"]):
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    results.append(code)
print("RESULT", results, "torch" in sys.modules, "placement" in sys.modules)
"""
    done = run_child([sys.executable, "-c", probe], env=env())
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert result == "RESULT [0, 0, 0, 0, 2, 2, 2, 2] False False", done.stdout + done.stderr
    assert "is not DEVICE=SIZE nor NxSIZE; write e.g. 0=24GiB,1=24GiB,cpu=64GiB or 2x24GiB" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_target_that_names_nothing_is_told_before_torch_loads(tmp_path):
    """A missing folder (plan, run, inspect), a preset one letter off and an --out that is a file: one line and exit
    code 2 in well under a second, because nothing imports torch on the way (checked, not timed)."""
    out_file = tmp_path / "taken.txt"
    out_file.write_text("not a folder")
    probe = f"""
import sys
from pipelines.cli import main
results = []
for argv in (["plan", "/no/such/folder"], ["run", "/no/such", "--prompts", "p.txt", "--out", "o"],
             ["inspect", "/no/such"], ["plan", "tiny_flux"], ["plan", "./no-such", "--svg", "{tmp_path}"],
             ["run", "tiny-flux", "--prompts", "p.txt", "--out", "{out_file}"]):
    results.append(main(argv))
print("RESULT", results, "torch" in sys.modules, "placement" in sys.modules)
"""
    done = run_child([sys.executable, "-c", probe], env=env())
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert result == "RESULT [2, 2, 2, 2, 2, 2] False False", done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[:3] == [f"placement {command}: error: No such folder: {target!r} (looked for "
                         f"{str(Path(target).resolve())!r}). Check the path; a Hub id is written owner/name."
                         for command, target in (("plan", "/no/such/folder"), ("run", "/no/such"),
                                                 ("inspect", "/no/such"))]
    assert lines[3].startswith("placement plan: error: 'tiny_flux' is not a preset; did you mean 'tiny-flux'?")
    assert lines[4] == f"placement plan: error: --svg {str(tmp_path)!r} is a folder; name a file in it, e.g. " \
                       f"{str(tmp_path / 'plan.svg')!r}."
    assert lines[5] == f"placement run: error: --out {str(out_file)!r} is a file, not a folder; name a folder (it " \
                       "is made if it does not exist)."
    assert len(lines) == 6, done.stderr


def test_the_no_accelerator_warning_is_printed_once_in_flag_names():
    done = placement_command("plan", "tiny-flux", "--max-memory", "cpu=8GiB")
    both = done.stdout + done.stderr
    assert done.returncode == 0, both
    assert both.count("No accelerator to plan for") == 1
    assert "--max-memory 0=24GiB,..." in both and "max_memory={" not in both
    preset, verdict = done.stdout.splitlines()[:2]  # which classes the preset stands for, then the verdict
    assert preset.startswith("Preset tiny-flux: ") and verdict.startswith("Verdict: runs on the CPU only")


def test_a_device_named_twice_is_refused_without_a_traceback():
    done = placement_command("plan", "tiny-flux", "--max-memory", "0=1GiB,cuda:0=2GiB")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--max-memory 0=1GiB,cuda:0=2GiB names GPU 0 twice ('0' and 'cuda:0'); keep one." in done.stderr


@pytest.mark.filterwarnings("ignore:No accelerator to plan for")
def test_errors_name_flags_not_keyword_arguments(capsys):
    from pipelines.cli import main

    assert main(["plan", "sdxl", "--max-memory", "0=1GiB,cpu=2GiB"]) == 2
    err = capsys.readouterr().err
    assert "--offload-folder DIR" in err and "offload_folder" not in err and "a larger --max-memory" in err
