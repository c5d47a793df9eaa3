"""`placement calibrate` on a CPU machine (issue 38): it measures what there is, says what it could not, saves the
profile in the cache folder (PLACEMENT_CACHE_DIR here), and `placement plan` then names it; bad input is one
line, never a traceback; `placement run`'s log sets measured beside predicted seconds per component."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main
from placement.machine_profile import CACHE_ENV

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
CALL = ["--height", "64", "--width", "64", "--steps", "2"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    return tmp_path / "cache"


def test_calibrate_saves_the_profile_and_plan_names_it(cache, capsys):
    assert main(["calibrate", "--quick", "--seconds", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "CPU matmul float32:" in out and "disk read" in out and "host RAM:" in out
    assert "not measured: every GPU figure" in out and "no CUDA GPU" in out
    saved = cache / "machine-profile.json"
    assert f"Saved this machine's profile to {saved}" in out
    data = json.loads(saved.read_text())
    assert data["version"] == 1 and data["host"]["conv_flops"]["float32"] > 0 and data["gpus"] == []

    assert main(["plan", "tiny-flux", "--max-memory", "cpu=8GiB", *CALL]) == 0
    predicted = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Predicted: about"))
    assert "CPU and disk: profile: measured on this machine" in predicted and str(saved) in predicted


def test_bad_input_is_one_line_without_a_traceback(cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--seconds", "0"])
    assert exit_.value.code == 2 and "--seconds 0: give the seconds per figure" in capsys.readouterr().err
    afile = tmp_path / "a-file"
    afile.write_text("")
    assert main(["calibrate", "--quick", "--disk-folder", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "--disk-folder" in err and "is a file, not a folder" in err and "Traceback" not in err
    cache.mkdir(parents=True)
    (cache / "machine-profile.json").write_text("{")
    assert main(["plan", "tiny-flux", "--max-memory", "cpu=8GiB"]) == 2
    err = capsys.readouterr().err
    assert "machine-profile.json cannot be read" in err and "placement calibrate" in err and "Traceback" not in err


def test_run_logs_measured_against_predicted_per_component(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue sphere\n")
    code = main(["run", "tiny-flux", "--prompts", str(prompts), "--out", str(tmp_path / "images"),
                 "--max-memory", "0=2GiB,1=2GiB,cpu=4GiB", *CALL])
    out = capsys.readouterr().out
    assert code == 0
    assert "Measured vs predicted per component, call 2 of the calls timed:" in out  # two images: two calls
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        assert any(line.strip().startswith(f"{name} ") and "measured" in line and "predicted" in line
                   for line in out.splitlines())
