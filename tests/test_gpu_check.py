"""benchmarks/gpu_check.py in its CPU mode (issue 38): on a virtual GPU and a narrow DiT it calibrates into the
profile folder given, says the gpu tests are not run, places the DiT resident, streamed and per call, and prints
for each measured vs predicted seconds and the placement report (streamed and per call: the trace's overlap too).
The figures are the CPU's: only their presence is held."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_the_cpu_mode_runs_every_step_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLACEMENT_CACHE_DIR", str(tmp_path / "unused"))  # main sets its own; restored after
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    assert gpu_check.main(["--cpu", "--cache", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "calibrate (exit 0):" in out and "Saved this machine's profile to" in out
    assert "gpu tests: not run in --cpu mode" in out
    for label in ("resident", "streamed", "per call"):
        line = next(line for line in out.splitlines() if line.startswith(f"{label}: measured"))
        assert "predicted" in line and "per call" in line
    assert out.count("  overlap: copies") == 2  # streamed and per call move weights; resident does not
    assert out.count("Measured vs predicted per component") == 3
    profile = json.loads((tmp_path / "cache" / "machine-profile.json").read_text())
    assert profile["gpus"][0]["name"] == "virtual accelerator (CPU)"
    lines = out.splitlines()
    per_call = lines.index(next(line for line in lines if line.startswith("per call: measured")))
    assert "moves 0.000 GiB" not in lines[per_call]  # the per-call plan loads the denoiser's blocks every call
