"""`placement plan --gpu NAME`: the predicted seconds per call on a named GPU (issue 29)."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def test_plan_with_a_call_on_a_named_gpu_prints_the_seconds_per_call(tmp_path, capsys):
    target = tmp_path / "plan.json"
    code = main(["plan", "tiny-flux", "--max-memory", "0=1GiB,cpu=8GiB", "--height", "64", "--width", "64",
                 "--steps", "4", "--gpu", "H100", "--json", str(target)])
    out = capsys.readouterr().out
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("Predicted: about"))
    # tiny-flux is planned onto the CPU here (no accelerator holds anything): the predicted time names the CPU that
    # runs it, not the profile named for the GPU (issue 41: it said "on H100" for a CPU-only plan)
    assert "per call on the CPU, +-15%: compute" in line and line.endswith("(named (--gpu)).")
    assert "Predicted time per call on H100" in out
    saved = json.loads(target.read_text())
    assert saved["gpu"]["key"] == "h100" and saved["inputs"]["gpu"] == "h100" and saved["seconds_per_call"] > 0
    assert all(c["flops_per_run"] > 0 for c in saved["components"].values())


def test_plan_without_a_call_says_no_time_and_an_unknown_gpu_is_refused_with_the_known_ones(capsys):
    assert main(["plan", "tiny-flux", "--max-memory", "0=1GiB,cpu=8GiB", "--gpu", "rtx4090"]) == 0
    assert "Predicted" not in capsys.readouterr().out  # weights only: no FLOPs, no seconds
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny-flux", "--gpu", "rtx4080"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu 'rtx4080' names no GPU profile" in err and "Did you mean 'rtx4090'" in err
    assert "Traceback" not in err


def test_plan_timeline_writes_the_predicted_call_as_a_chrome_trace(tmp_path, capsys):
    target = tmp_path / "timeline.json"
    code = main(["plan", "tiny-flux", "--max-memory", "0=1GiB,cpu=8GiB", "--height", "64", "--width", "64",
                 "--steps", "4", "--gpu", "rtx4090", "--timeline", str(target)])
    out = capsys.readouterr().out
    assert code == 0 and f"Predicted timeline written to {target}" in out
    events = json.loads(target.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    runs = [e for e in spans if e["args"]["component"] == "transformer" and e["args"]["block"] == ""]
    assert len(runs) == 4 and all(e["dur"] > 0 for e in runs)  # one span per step, with its compute
    assert [e["ts"] for e in runs] == sorted(e["ts"] for e in runs)
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} >= {"compute", "copy"}


def test_only_one_output_may_go_to_stdout(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny-flux", "--json", "-", "--timeline", "-"])
    assert exit_.value.code == 2
    assert "--json - and --timeline - would all write to stdout" in capsys.readouterr().err
