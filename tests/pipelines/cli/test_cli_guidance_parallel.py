"""`placement plan --guidance-parallel {auto,on,off}` (issue 39): the choice reaches the plan, and `on` where it
cannot apply says why; a misspelt value is refused by argparse without a traceback."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.mark.parametrize("flag, recorded", [("auto", None), ("on", True), ("off", False)])
def test_the_flag_reaches_the_plan(tmp_path, capsys, flag, recorded):
    target = tmp_path / "plan.json"
    assert main(["plan", "tiny-flux", "--max-memory", "0=1GiB,1=1GiB,cpu=8GiB", "--height", "64", "--width", "64",
                 "--guidance-parallel", flag, "--json", str(target)]) == 0
    saved = json.loads(target.read_text())
    assert saved["inputs"]["guidance_parallel"] is recorded
    out = capsys.readouterr().out
    # FLUX.1-dev's guidance is distilled (one call of a batch of one per step): whatever the flag, the plan says why
    # its guidance does not run in parallel
    assert "guidance branches not in parallel: transformer runs once per step" in out


def test_a_misspelt_value_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny-flux", "--guidance-parallel", "yes"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--guidance-parallel" in err and "'yes'" in err and "Traceback" not in err
