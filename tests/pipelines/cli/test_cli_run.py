"""`placement run` as a user leaves it running: the verdict first, each image written at once and atomically, a
rerun that skips what is done, Ctrl-C that stops after the current image, the pipeline's own defaults, and
replicas under torchrun on a CPU machine through virtual accelerators."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from tqdm.auto import tqdm

import diffusers

from pipelines import Pipeline
from pipelines.cli import main
from pipelines.cli.targets import default_call
from pipelines.distributed.images import ImageRecord, RunFolder, write_atomically
from pipelines.distributed.job import counting_steps, run_bar
from pipelines.errors import ImageRunError
from pipelines.presets.catalog import preset_folder

from child_process import finish, run_child, wait_for

ROOT = Path(__file__).resolve().parents[2]
CALL = ["--height", "64", "--width", "64", "--steps", "2"]

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
needs_torchrun = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with Gloo cannot spawn here"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny-flux preset (diffusers' FluxPipeline at tiny configs, seed 0) copied into a folder of the test's."""
    import shutil

    folder = tmp_path_factory.mktemp("run") / "tiny-flux"
    shutil.copytree(preset_folder("tiny-flux"), folder)
    return folder


def prompts_file(tmp_path: Path, count: int) -> Path:
    path = tmp_path / f"prompts-{count}.txt"
    path.write_text("\n".join(f"prompt number {i}" for i in range(count)) + "\n")
    return path


def env(**extra: str) -> dict:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PLACEMENT_VIRTUAL_ACCELERATORS")
    base = {key: value for key, value in os.environ.items() if key not in launcher}
    return {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def test_the_verdict_comes_first_and_a_rerun_makes_only_what_is_missing(tiny, tmp_path, capsys):
    out = tmp_path / "images"
    assert main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 2)), "--out", str(out), *CALL]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Verdict: ") and "2 image(s) made by 1 replica(s)" in printed
    first = (out / "00000.png").read_bytes()
    assert main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 2)), "--out", str(out), *CALL]) == 0
    assert capsys.readouterr().out.startswith("All 2 image(s) are already in")  # nothing loaded, nothing made
    assert main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 3)), "--out", str(out), *CALL]) == 0
    printed = capsys.readouterr().out
    assert "1 image(s) made by 1 replica(s)" in printed and "2 already there" in printed
    run = json.loads((out / "run.json").read_text())
    assert [image["file"] for image in run["images"]] == ["00000.png", "00001.png", "00002.png"]
    assert (out / "00000.png").read_bytes() == first


def test_another_call_into_the_same_folder_is_refused_unless_overwrite(tiny, tmp_path, capsys):
    out, prompts = tmp_path / "images", prompts_file(tmp_path, 1)
    assert main(["run", str(tiny), "--prompts", str(prompts), "--out", str(out), *CALL]) == 0
    capsys.readouterr()
    other = ["--height", "64", "--width", "64", "--steps", "3"]
    assert main(["run", str(tiny), "--prompts", str(prompts), "--out", str(out), *other]) == 2
    err = capsys.readouterr().err
    assert "holds images of another run" in err and "'num_inference_steps': 2" in err and "--overwrite" in err
    assert main(["run", str(tiny), "--prompts", str(prompts), "--out", str(out), *other, "--overwrite"]) == 0
    assert json.loads((out / "run.json").read_text())["call"]["num_inference_steps"] == 3


def test_defaults_are_the_pipelines_own(tiny, tmp_path):
    # FluxPipeline.__call__'s own (28 steps, guidance 3.5); its height=None: FLUX's transformer has no sample_size,
    # so FluxPipeline's own default_sample_size (128) times the tiny VAE's scale factor (2)
    assert default_call(tiny, Pipeline) == {"height": 256, "width": 256, "num_inference_steps": 28,
                                            "guidance_scale": 3.5}


def test_defaults_of_a_diffusers_folder_follow_its_class_and_configs(tmp_path):

    folder = tmp_path / "sd"
    (folder / "unet").mkdir(parents=True)
    (folder / "vae").mkdir()
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": diffusers.__version__,
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}))
    (folder / "unet" / "config.json").write_text(json.dumps({"sample_size": 64}))
    (folder / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    # StableDiffusionPipeline.__call__: height=None (unet sample_size x 2**3), 50 steps, guidance 7.5
    assert default_call(folder, Pipeline) == {"height": 512, "width": 512, "num_inference_steps": 50,
                                              "guidance_scale": 7.5}


def test_guidance_and_negative_prompt_reach_the_pipeline(tiny, tmp_path, monkeypatch):
    seen = []
    original = diffusers.FluxPipeline.__call__

    @functools.wraps(original)  # the plan reads __call__'s signature (call capture): the spy keeps FluxPipeline's
    def spy(self, prompt, **kwargs):
        seen.append(kwargs)
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(diffusers.FluxPipeline, "__call__", spy)
    assert main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 1)), "--out", str(tmp_path / "o"),
                 "--guidance-scale", "1.5", "--negative_prompt", "blurry", "--steps", "1", "--height", "64",
                 "--width", "64"]) == 0
    (kwargs,) = [call for call in seen if "generator" in call]  # the image's call (planning captured one before)
    assert kwargs["guidance_scale"] == 1.5 and kwargs["negative_prompt"] == "blurry"
    assert kwargs["num_inference_steps"] == 1


def test_group_size_without_torchrun_is_an_error_not_ignored(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 1)), "--out", str(tmp_path / "o"),
              "--group-size", "2"])
    assert exit_info.value.code == 2 and "--group-size sets the GPUs of each replica under torchrun" in \
        capsys.readouterr().err


def test_gpu_budgets_on_a_machine_without_accelerators_are_an_error_not_ignored(tiny, tmp_path, capsys,
                                                                                monkeypatch):
    """As the README says: a plain run given --max-memory 0=... with no accelerator at all would run on the CPU
    and advise about a GPU it lacks; it is refused before anything is planned, naming the GPU and what to do."""
    import pipelines.distributed.replica as replica
    from placement.devices import Accelerators

    argv = ["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 1)), "--out", str(tmp_path / "o"),
            "--max-memory", "0=2GiB,cpu=4GiB", *CALL]
    with monkeypatch.context() as no_gpu:
        no_gpu.setattr(replica, "detect_accelerators", lambda: Accelerators(count=0, kind="cuda"))
        assert main(argv) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("placement run: error: --max-memory names GPU 0, but this machine has no "
                                  "accelerator (no CUDA, XPU or MPS device is visible), so the pipeline would run on "
                                  "the CPU. Give budgets only for cpu and disk (or none)"), printed.err
    assert "PLACEMENT_VIRTUAL_ACCELERATORS=N" in printed.err and "Verdict" not in printed.out
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")  # with an accelerator the same budgets are used
    assert main(argv) == 0 and "1 image(s) made" in capsys.readouterr().out


def test_one_bar_counts_every_step_of_every_image(tiny):
    pipe = Pipeline.from_pretrained(tiny, progress=False)
    assert run_bar(images=2, steps=3, enabled=True).total == 6
    drawn = io.StringIO()
    bar = tqdm(total=6, file=drawn, disable=False)  # run_bar's, drawn where the test can read it
    with counting_steps(pipe, bar):
        for _ in range(2):
            pipe("a fox", height=64, width=64, num_inference_steps=3, output_type="pt")
    bar.close()
    assert bar.n == 6 and "6/6" in drawn.getvalue() and "Denoising" not in drawn.getvalue()
    assert "progress_bar" not in vars(pipe)  # the pipeline's own step bar is back afterwards


def test_a_write_cut_short_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "run.json"
    target.write_bytes(b"previous")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ImageRunError, match=f"Cannot write {str(target)!r}: No space left on device"):
        write_atomically(target, b"new and longer")
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_prompts_file_that_is_not_utf8_is_named_with_the_line(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a lighthouse\nun caf\u00e9\n".encode("latin-1"))  # saved by an editor in Latin-1
    code = main(["run", str(tiny), "--prompts", str(prompts), "--out", str(tmp_path / "images"), *CALL])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "internal error" not in err
    assert f"The prompts file {str(prompts)!r} is not UTF-8 text (byte 19, line 2" in err and "Save it as UTF-8" in err


def test_run_json_lists_each_image_as_soon_as_it_is_written(tmp_path):
    folder = RunFolder(tmp_path / "out", source="x", call={"height": 8}, seed=0, overwrite=False)
    assert folder.todo(["a", "b"]) == [0, 1]
    record = ImageRecord(index=1, prompt="b", seed=1, rank=0, replica="the CPU", seconds=0.5, png=b"\x89PNG")
    folder.write(record, world_size=1)
    written = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [image["index"] for image in written["images"]] == [1] and written["call"] == {"height": 8}
    again = RunFolder(tmp_path / "out", source="x", call={"height": 8}, seed=0, overwrite=False)
    assert again.todo(["a", "b"]) == [0] and again.todo(["a", "b", "c"]) == [0, 2]
    with pytest.raises(ImageRunError, match="00001.png was made for 'b' \\(now 'changed'\\)"):
        again.todo(["a", "changed"])  # made again, it would replace that image without a word (issue 42)


def test_ctrl_c_stops_after_the_current_image_with_one_line(tiny, tmp_path):
    out = tmp_path / "images"
    command = [sys.executable, "-m", "pipelines.cli", "run", str(tiny), "--prompts", str(prompts_file(tmp_path, 40)),
               "--out", str(out), "--height", "64", "--width", "64", "--steps", "6"]
    process = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (out / "00000.png").exists(), process, "first image")
    process.send_signal(signal.SIGINT)
    stdout, stderr = finish(process)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("placement run:")]
    assert len(lines) == 1 and "stopped on request" in lines[0] and "run the same command again" in lines[0]
    written = sorted(p.name for p in out.iterdir())
    listed = [image["file"] for image in json.loads((out / "run.json").read_text())["images"]]
    assert written == [*listed, "run.json"] and 0 < len(listed) < 40  # no temporary file, no half image


def test_ctrl_c_during_start_up_says_what_stopped_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    import pipelines.hf.quiet as quiet_module

    def interrupted(*args, **kwargs):  # Ctrl-C while the pipeline class is read: a bare KeyboardInterrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(quiet_module, "quiet", interrupted)
    out = tmp_path / "images"
    code = main(["run", str(tiny), "--prompts", str(prompts_file(tmp_path, 2)), "--out", str(out), *CALL])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith("placement run: interrupted (Ctrl-C) before it finished; run the same command again")


@pytest.mark.torchrun
@needs_torchrun
def test_torchrun_on_a_cpu_honours_virtual_accelerators_budgets_and_group_size(tiny, tmp_path):
    prompts = prompts_file(tmp_path, 3)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "pipelines.cli", "run", str(tiny), "--prompts", str(prompts), *CALL]
    done = run_child([*launch, "--out", str(tmp_path / "virtual"), "--max-memory", "2x2GiB,cpu=8GiB"],
                     env=env(PLACEMENT_VIRTUAL_ACCELERATORS="2"))
    assert done.returncode == 0, done.stderr
    assert "2 replica(s); rank 0 on GPU 0: Verdict: fits on accelerators" in done.stdout
    run = json.loads((tmp_path / "virtual" / "run.json").read_text())
    assert [(image["rank"], image["replica"]) for image in run["images"]] == [(0, "GPU 0"), (1, "GPU 1"), (0, "GPU 0")]

    grouped = run_child([*launch, "--out", str(tmp_path / "grouped"), "--max-memory", "2x2GiB,cpu=8GiB",
                         "--group-size", "2"], env=env(PLACEMENT_VIRTUAL_ACCELERATORS="2"))
    assert grouped.returncode != 0 and "1 replica of 2 GPUs" in grouped.stderr  # 2 processes, 1 group of 2

    no_accelerator = run_child([*launch, "--out", str(tmp_path / "none"), "--max-memory", "2x2GiB"], env=env())
    # torchrun's agent prints its own traceback for a failed worker; none comes from our processes
    assert no_accelerator.returncode != 0 and f"{ROOT / 'pipelines'}" not in no_accelerator.stderr
    assert no_accelerator.stderr.count("this machine has no accelerator") == 1  # said once, by rank 0
    assert "PLACEMENT_VIRTUAL_ACCELERATORS=N" in no_accelerator.stderr


@pytest.mark.parametrize("preset, side", [("flux", 1024), ("tiny-flux", 256), ("sd15", 512), ("sdxl", 1024)])
def test_a_diffusers_folders_default_size_follows_diffusers_rule(tmp_path, monkeypatch, preset, side):
    """height=None in diffusers: the denoiser's sample_size, else the pipeline's own default_sample_size (FluxPipeline
    sets 128 in its __init__, read from its source), times the VAE's scale factor."""
    from pipelines.cli.targets import default_call
    from pipelines.distributed.replica import folder_pipeline_class
    from pipelines.presets.catalog import preset_folder

    monkeypatch.setenv("PLACEMENT_CACHE_DIR", str(tmp_path))
    folder = preset_folder(preset)
    call = default_call(folder, folder_pipeline_class(folder))
    assert (call["height"], call["width"]) == (side, side)
