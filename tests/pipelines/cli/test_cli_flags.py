"""The `placement` command forgives habits and speaks to scripts: suggestions for mistyped flags and commands,
`--max_memory` spellings, `--json -`, a reader that closes the pipe, `python -m placement`, budgets typed
without a unit, and the advice a plan's outcome calls for (bf16, a detected CPU budget, the runtime overhead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import build_parser, main
from pipelines.cli.args import call_spec
from placement import Plan

from child_process import run_child

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def python(*args: str, stdin=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return run_child([sys.executable, *args], env=env)


def argparse_exit(argv, capsys) -> tuple[int, str]:
    """argparse's exit code and what it printed (help on stdout, errors on stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out + captured.err


def test_a_mistyped_strategy_is_refused_with_the_closest_name_before_anything_is_planned(capsys):
    from pipelines.cli.args import STRATEGY_NAMES
    from placement.strategies.state import NAMED_STRATEGIES

    assert STRATEGY_NAMES == tuple(kind.value for kind in NAMED_STRATEGIES)  # the CLI's copy, kept torch-free
    from pipelines.cli.args import PRESET_NAMES
    from pipelines.presets.catalog import FOLDER_PRESETS

    # the CLI's copy too (diffusers' and transformers' classes): a mistyped preset is told before torch loads
    assert PRESET_NAMES == FOLDER_PRESETS
    code, err = argparse_exit(["run", "tiny-flux", "--prompts", "p.txt", "--out", "o", "--strategy", "balance"], capsys)
    assert code == 2 and "unknown strategy 'balance' (did you mean 'balanced'?)" in err
    # every device spelling placement.devices.normalize_device reads passes on to it (the CLI's copy of them)
    for accepted in ("sequential", "cuda", "cuda:1", "xpu:0", "mps", "npu:1", "vgpu:1", "0", "cpu", "disk",
                     '{"denoiser": 0}'):
        assert build_parser().parse_args(["plan", "tiny-flux", "--strategy", accepted]).strategy is not None


def test_a_mistyped_flag_or_command_gets_the_closest_one(capsys):
    code, err = argparse_exit(["plan", "tiny-flux", "--max-memroy", "0=1GiB"], capsys)
    assert code == 2 and "unrecognized argument" in err and "--max-memroy (did you mean --max-memory?)" in err
    code, err = argparse_exit(["pln", "tiny-flux"], capsys)
    assert code == 2 and "unknown command 'pln' (did you mean plan?)" in err


def test_underscore_spellings_work_and_stay_out_of_help(tmp_path, capsys):
    target = tmp_path / "plan.json"
    assert main(["plan", "tiny-flux", "--max_memory", "2x1GiB,cpu=2GiB", "--offload_folder", str(tmp_path),
                 "--json", str(target)]) == 0
    assert Plan.from_json(target.read_text()).inputs.max_memory == {0: 2**30, 1: 2**30, "cpu": 2 * 2**30}
    assert main(["plan", "tiny-flux", "--max_memory=cpu=2GiB", "--height", "64", "--width", "64",
                 "--batch_size", "2"]) == 0
    assert "batch_size=2" in capsys.readouterr().out
    code, help_text = argparse_exit(["plan", "--help"], capsys)
    assert code == 0 and "--max-memory" in help_text and "--max_memory" not in help_text


def test_json_dash_is_stdout_alone_and_the_table_goes_to_stderr(capsys):
    assert main(["plan", "tiny-flux", "--max-memory", "2x1GiB,cpu=2GiB", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert Plan.from_json(captured.out).device_map  # stdout parses as a plan: nothing else is on it
    assert captured.err.startswith("Preset tiny-flux: diffusers' FluxPipeline") and "Plan written to stdout" in captured.err
    assert captured.err.splitlines()[1].startswith("Verdict: ")


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    shell = (f"{sys.executable} -m pipelines.cli plan flux --max-memory 2x24GiB,cpu=64GiB --dtype bf16 "
             "--json - | head -c 10")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run_child(["bash", "-o", "pipefail", "-c", shell], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{\n  "schem' and "Broken pipe" not in done.stderr and "Traceback" not in done.stderr


def test_python_dash_m_placement_is_the_command_and_placement_still_imports_no_pipelines():
    done = python("-m", "placement", "plan", "tiny-flux", "--max-memory", "cpu=2GiB")
    assert done.returncode == 0 and done.stdout.splitlines()[1].startswith("Verdict: "), done.stderr
    probe = python("-c", "import placement, sys; print('pipelines' in sys.modules)")
    assert probe.stdout.strip() == "False"


def test_demo_output_with_a_non_image_extension_names_it(capsys):
    code, err = argparse_exit(["demo", "--output", "out.txt"], capsys)
    assert code == 2 and "extension '.txt' is not an image format" in err and "demo.png" in err
    assert "internal error" not in err


def test_a_budget_without_its_unit_is_refused_and_a_zero_gpu_warned_about(capsys):
    assert main(["plan", "tiny-flux", "--max-memory", "0=24"]) == 2
    err = capsys.readouterr().err
    assert "--max-memory 0=24: '24' means 24 bytes" in err and "did you mean '24GiB'?" in err
    assert main(["plan", "tiny-flux", "--max-memory", "0=0GiB,1=1GiB,cpu=2GiB"]) == 0
    err = capsys.readouterr().err
    assert err.count("--max-memory gives GPU 0 a budget of 0 bytes") == 1 and "max_memory" not in err


def test_an_fp32_plan_that_fails_says_what_bf16_would_do_and_that_the_cpu_budget_was_detected(capsys):
    assert main(["plan", "flux", "--max-memory", "2x20GiB"]) == 2
    err = capsys.readouterr().err
    assert "must go to disk" in err  # the original error, then what would help, computed
    assert "this plan is in float32; in bfloat16 (--dtype bf16, half the bytes) it fits on accelerators" in err.lower()
    assert "The CPU budget was detected on this machine" in err and "--max-memory 2x20GiB,cpu=64GiB" in err


def test_an_offloaded_fp32_plan_says_what_bf16_would_do(capsys):
    assert main(["plan", "flux", "--max-memory", "2x24GiB,cpu=128GiB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("Verdict: fits with offloading")
    # said once, among the plan's suggestions (the table's warnings), not again as a hint after it
    assert "Suggestion: this plan is in float32; in bfloat16 (--dtype bf16, half the bytes) it fits on accelerators" \
        in out and "hint: This plan is in float32" not in out
    assert main(["plan", "flux", "--max-memory", "2x24GiB,cpu=128GiB", "--dtype", "bf16"]) == 0
    assert "hint:" not in capsys.readouterr().out  # it fits: nothing to add


def test_gpus_left_empty_by_the_runtime_overhead_are_explained(capsys):
    assert main(["plan", "tiny-flux", "--max-memory", "2x1GiB,cpu=2GiB", "--height", "64", "--width", "64"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0 and GPU 1 hold nothing: with a call planned for, each GPU in use keeps 1.00 GiB" in out
    assert "a budget of 1.00 GiB each leaves no room" in out


def test_steps_plan_the_call_num_inference_steps(tmp_path, capsys):
    target = tmp_path / "plan.json"
    assert main(["plan", "tiny-flux", "--max-memory", "2x8GiB,cpu=8GiB", "--height", "64", "--width", "64",
                 "--steps", "28", "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "Planned for the call: height=64, width=64, num_inference_steps=28" in out
    inputs = json.loads(target.read_text())["inputs"]
    assert inputs["call"]["num_inference_steps"] == 28
    assert inputs["runs_per_call"]["transformer"] == 28


def test_strength_reaches_the_call_and_is_refused_where_nothing_starts_from_an_image(capsys):
    args = build_parser().parse_args(["plan", "x", "--height", "64", "--width", "64", "--strength", "0.3"])
    assert call_spec(args) == {"height": 64, "width": 64, "strength": 0.3}
    for size in (["--height", "64", "--width", "64"], []):  # alone, planned at the pipeline's own size
        assert main(["plan", "tiny-sd15", "--max-memory", "2x8GiB,cpu=8GiB", *size, "--strength", "0.5"]) == 2
        err = capsys.readouterr().err
        assert "--strength 0.5: StableDiffusionPipeline does not start from an image" in err
        assert "leave --strength out" in err and "call=" not in err
        assert "--height" not in err


def test_call_flags_alone_plan_for_the_pipelines_own_size(tmp_path, capsys):
    target = tmp_path / "plan.json"
    # diffusers' rule: the UNet's sample_size (32) times the VAE's downsampling (2 blocks: 2)
    assert main(["plan", "tiny-sd15", "--max-memory", "2x8GiB,cpu=8GiB", "--steps", "28", "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "Planned for the call: height=64, width=64, num_inference_steps=28 (height and width: the pipeline's " \
           "default)" in out
    # sd15's published scheduler (PNDM, Runge-Kutta warm-up skipped) runs the UNet once more than the steps asked
    assert json.loads(target.read_text())["inputs"]["runs_per_call"]["unet"] == 29
    assert main(["plan", "tiny-sd15", "--max-memory", "2x8GiB,cpu=8GiB", "--height", "256"]) == 0
    assert "Planned for the call: height=256, width=64 (width: the pipeline's default)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["--steps", "0"], "argument --steps: 0 is not 1 or more; write e.g. --steps 28."),
    (["--steps", "-3"], "argument --steps: -3 is not 1 or more"),
    (["--height", "1.5"], "argument --height: '1.5' is not a whole number"),
    (["--strength", "1.5"], "argument --strength: 1.5 is not above 0 and at most 1"),
    (["--guidance-scale", "nan"], "argument --guidance-scale: 'nan' is not a finite number"),
    (["--max-memory", "-1=24GiB"], "device '-1' is negative; GPUs are numbered from 0"),
    (["--max-memory", "0:24GiB"], "'0:24GiB' separates device and size with ':'; write 0=24GiB"),
])
def test_argument_mistakes_are_one_line_with_their_own_words(capsys, argv, said):
    code, err = argparse_exit(["plan", "tiny-flux", *argv], capsys)
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert err.endswith("(see 'placement plan --help')\n") and "usage:" not in err


def test_version_and_debug_are_listed_and_version_answers(capsys):
    code, out = argparse_exit(["--version"], capsys)
    assert code == 0 and out.startswith("placement ")
    for argv in (["--help"], ["plan", "--help"], ["run", "--help"]):
        code, out = argparse_exit(argv, capsys)
        assert code == 0 and "--debug" in out and "usage:" in out  # the usage block: with --help only
    code, out = argparse_exit(["--help"], capsys)
    assert "--version" in out


@pytest.mark.parametrize("target", ["./no-such-pipeline", "no-such-pipeline/"])
def test_a_bad_path_gets_its_own_message_and_no_advice_about_budgets(capsys, target):
    assert main(["plan", target, "--max-memory", "2x24GiB"]) == 2
    err = capsys.readouterr().err
    assert f"No such folder: {target!r}" in err and "CPU budget" not in err and "bfloat16" not in err
    assert "not a preset" not in err and "Repo id" not in err


@pytest.mark.skipif(__import__("placement.devices").devices.accelerators_present() > 0,
                    reason="about a machine without accelerators")
def test_a_pipeline_too_big_for_a_cpu_machine_is_told_the_likeliest_fix_first(capsys, monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: {"cpu": 16 * 2**30})  # a 16 GiB laptop
    assert main(["plan", "flux"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Likeliest fixes first: (1) This machine has no GPU" in err
    gpus = "with --dtype bf16 --max-memory 2x24GiB,cpu=64GiB it fits on accelerators"  # worked out, not guessed
    assert gpus in err and err.index(gpus) < err.index("(2) Its weights must go to disk") < err.index(
        "--offload-folder DIR")
    assert main(["plan", "tiny-flux"]) == 0  # fits here, on the CPU: what GPUs would do is a hint after the plan
    assert "hint: This machine has no GPU, so this plan is for its CPU alone" in capsys.readouterr().out
