"""`placement plan --guidance-parallel {auto,on,off}` (issue 39): the choice reaches the plan, and `on` where the
call's guidance is not known says so; a misspelt value is refused by argparse without a traceback."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.mark.parametrize("flag, recorded", [("auto", None), ("on", True), ("off", False)])
def test_the_flag_reaches_the_plan(tmp_path, capsys, flag, recorded):
    target = tmp_path / "plan.json"
    assert main(["plan", "tiny-dit", "--max-memory", "0=1GiB,1=1GiB,cpu=8GiB", "--guidance-parallel", flag,
                 "--json", str(target)]) == 0
    saved = json.loads(target.read_text())
    assert saved["inputs"]["guidance_parallel"] is recorded
    out = capsys.readouterr().out
    # tiny-dit is this library's own pipeline, whose call capture does not run: its guidance is not known
    assert ("the call's guidance is not known" in out) is (flag == "on")


def test_a_misspelt_value_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "tiny-dit", "--guidance-parallel", "yes"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--guidance-parallel" in err and "'yes'" in err and "Traceback" not in err
