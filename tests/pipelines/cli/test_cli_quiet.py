"""`pipelines.hf.quiet`: what other libraries print during our plans and loads is silenced, ours is not, and
everything is as it was afterwards; `placement plan` / `run` of a diffusers folder print only our own lines."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pipelines.hf.quiet import quiet

from child_process import run_child

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("torchvision", "Failed to load", "_pytree", "kernels", "Unable to import", "Loading weights")


def test_third_party_logs_and_warnings_are_silenced_inside_and_restored_after(caplog):
    logger = logging.getLogger("transformers.models.clip")
    before = {name: logging.getLogger(name).level for name in ("transformers", "diffusers", "torchao")}
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet():
            logger.warning("falls back to PIL")
            warnings.warn_explicit("deprecated internals", FutureWarning, "x.py", 1, module="diffusers.utils")
            warnings.warn("ours: no accelerator to plan for", UserWarning)
            logging.getLogger("diffusers").error("a real error still shows")
    assert [record.getMessage() for record in caplog.records] == ["a real error still shows"]
    assert [str(warning.message) for warning in caught] == ["ours: no accelerator to plan for"]
    assert {name: logging.getLogger(name).level for name in before} == before


def test_progress_bars_of_transformers_are_off_inside_and_back_after():
    transformers_logging = pytest.importorskip("transformers.utils.logging")
    from huggingface_hub.utils import are_progress_bars_disabled

    assert transformers_logging.is_progress_bar_enabled()
    with quiet(preload=("transformers",)):
        assert not transformers_logging.is_progress_bar_enabled()
        assert not are_progress_bars_disabled()  # downloads keep their bar
    assert transformers_logging.is_progress_bar_enabled()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_run_of_a_diffusers_folder_prints_only_our_lines(tmp_path):
    pytest.importorskip("transformers")
    from test_diffusers_pipelines import build_sd

    torch.manual_seed(0)
    build_sd(tmp_path / "parts").save_pretrained(tmp_path / "sd")
    (tmp_path / "prompts.txt").write_text("a lighthouse\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["run", str(tmp_path / "sd"), "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "images"),
            "--steps", "1", "--max-memory", "cpu=2GiB"]  # reads the class, plans (as `plan` does), loads, runs
    done = run_child([sys.executable, "-m", "pipelines.cli", *argv], env=env)
    assert done.returncode == 0, done.stderr
    assert not [word for word in NOISE if word in done.stdout + done.stderr], done.stderr
    assert done.stdout.startswith("Verdict: ") and (tmp_path / "images" / "00000.png").is_file()


def test_nested_blocks_put_back_exactly_what_the_outermost_found():
    filters_before = list(warnings.filters)
    transformers_level = logging.getLogger("transformers").level
    with quiet():
        with quiet():
            assert logging.getLogger("transformers").level == logging.ERROR
        assert logging.getLogger("transformers").level == logging.ERROR  # the inner block restored nothing
    assert warnings.filters == filters_before and logging.getLogger("transformers").level == transformers_level


LOAD_AND_PLAN = """
import logging, sys, warnings
import pipelines
folder = sys.argv[1]
budgets = {0: "2GiB", "cpu": "2GiB"}
plan = pipelines.Pipeline.plan_placement(folder, max_memory=budgets)
pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", max_memory=budgets)
print("LOADED", type(pipe).__name__, plan.verdict.kind.value, flush=True)
logging.getLogger("transformers").warning("the user's own transformers line")  # after we return: not ours to hush
warnings.warn_explicit("the user's own diffusers warning", UserWarning, "user.py", 1, module="diffusers.user")
"""


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_diffusers_load_and_plan_print_nothing_but_ours_and_leave_the_users_output_alone(tmp_path):
    pytest.importorskip("transformers")
    from test_diffusers_pipelines import build_sd

    torch.manual_seed(0)
    build_sd(tmp_path / "parts").save_pretrained(tmp_path / "sd")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PLACEMENT_VIRTUAL_ACCELERATORS": "1"}
    done = run_child([sys.executable, "-c", LOAD_AND_PLAN, str(tmp_path / "sd")], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "LOADED StableDiffusionPipeline fits on accelerators\n"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "the user's own transformers line" in lines[0] and "the user's own diffusers warning" in lines[1]
    assert len(lines) == 2, done.stderr  # nothing else: no import notices, no bars
