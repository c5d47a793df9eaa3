"""Bad inputs given to the `placement` command: each gets one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

from cases_calls import CLI, cli
from catalogue import Case


def run_twice_with_other_steps(tmp: Path):
    """Images of one call, then another call into the same --out."""
    from bad_input_models import tiny_flux_preset

    tiny_flux_preset(tmp / "tiny-flux")
    (tmp / "prompts.txt").write_text("a lighthouse\n")
    common = ("run", "{tmp}/tiny-flux", "--prompts", "{tmp}/prompts.txt", "--out", "{tmp}/images", "--height", "64",
              "--width", "64")
    cli(*common, "--steps", "1")(tmp)
    cli(*common, "--steps", "2")(tmp)


CASES = [
    Case(name="cli: a GPU budget without its unit", run=cli("plan", "{pipe}", "--max-memory", "0=24"),
         error=CLI, words=("0=24", "24 bytes", "did you mean '24GiB'")),
    Case(name="cli: a mistyped flag", run=cli("plan", "{pipe}", "--max-memroy", "0=1GiB"),
         error=CLI, words=("--max-memroy", "did you mean --max-memory")),
    Case(name="cli: a mistyped command", run=cli("pln", "{pipe}"), error=CLI, words=("'pln'", "did you mean plan")),
    Case(name="cli: demo --output with a text extension", run=cli("demo", "--output", "{tmp}/out.txt"),
         error=CLI, words=(".txt", "not an image format")),
    Case(name="cli: plan a local folder that does not exist", run=cli("plan", "./no-such-pipeline-folder"),
         error=CLI, words=("No such folder", "no-such-pipeline-folder")),
    Case(name="cli: run into a folder of another run", run=run_twice_with_other_steps,
         error=CLI, words=("another run", "--overwrite")),
    Case(name="cli: run a folder that loads as a generic pipeline",
         run=cli("run", "{pipe}", "--prompts", "{pipe}/model_index.json", "--out", "{tmp}/o"),
         error=CLI, words=("generic pipeline", "cannot be called")),
    Case(name="cli: run --group-size without torchrun",
         run=cli("run", "{pipe}", "--prompts", "{pipe}/model_index.json", "--out", "{tmp}/o", "--group-size", "2"),
         error=CLI, words=("--group-size", "torchrun")),
    Case(name="cli: calibrate for no time at all", run=cli("calibrate", "--seconds", "0"),
         error=CLI, words=("--seconds 0", "more than 0")),
    Case(name="cli: calibrate's drive folder is a file",
         run=cli("calibrate", "--quick", "--disk-folder", "{pipe}/model_index.json"),
         error=CLI, words=("--disk-folder", "is a file, not a folder")),
]
