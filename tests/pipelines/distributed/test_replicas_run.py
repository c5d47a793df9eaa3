"""`placement run` and `pipelines.distributed.load_replica`: one process, and two replicas under torchrun (Gloo,
CPU), give the same images; a replica that fails to load names its rank and no rank hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import diffusers
import pytest
import torch.distributed as dist

from pipelines.cli import main
from pipelines.distributed import Launch, load_replica

from child_process import run_child
from pipeline_fixtures import save_preset

ROOT = Path(__file__).resolve().parents[3]
CALL = ["--height", "64", "--width", "64", "--steps", "2"]
PROMPTS = ["a red fox", "a lighthouse at dusk", "a bowl of fruit"]

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
needs_torchrun = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with Gloo cannot spawn here"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_preset(tmp_path_factory.mktemp("replicas") / "tiny-flux")[0]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n")  # a blank line is no prompt
    return path


def run_python(args: list[str]) -> subprocess.CompletedProcess:
    # One thread everywhere: torchrun sets OMP_NUM_THREADS=1 for its workers, and CPU kernels may sum in a
    # different order with a different thread count.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return run_child([sys.executable, *args], env=env)


def torchrun(*args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


@pytest.mark.torchrun
@needs_torchrun
def test_two_replicas_under_torchrun_make_the_images_one_process_makes(tiny, prompts, tmp_path):
    plain = run_python(["-m", "pipelines.cli", "run", str(tiny), "--prompts", str(prompts), "--out",
                        str(tmp_path / "plain"), *CALL])
    assert plain.returncode == 0, plain.stderr
    launched = run_python(torchrun("-m", "pipelines.cli", "run", str(tiny), "--prompts", str(prompts), "--out",
                                   str(tmp_path / "replicas"), *CALL))
    assert launched.returncode == 0, launched.stderr
    for index in range(len(PROMPTS)):
        name = f"{index:05d}.png"
        assert (tmp_path / "replicas" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    run = json.loads((tmp_path / "replicas" / "run.json").read_text())
    assert run["world_size"] == 2
    made = [(image["index"], image["rank"], image["seed"]) for image in run["images"]]
    assert made == [(0, 0, 0), (1, 1, 1), (2, 0, 2)]  # prompt i on rank i % 2, seed 0 + i
    assert {image["prompt"] for image in run["images"]} == set(PROMPTS)


FLAKY_SCRIPT = """
import os, sys
from pipelines import Pipeline
from pipelines.distributed import ReplicaLoadError, load_replica

class Flaky(Pipeline):
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        if os.environ["RANK"] == "1":
            raise MemoryError("no room for the transformer on this rank")
        return super().from_pretrained(*args, **kwargs)

try:
    load_replica(sys.argv[1], ["a", "b"], pipeline_class=Flaky)
except ReplicaLoadError as error:
    print(f"rank {os.environ['RANK']} stopped: {error}")
    sys.exit(3)
print("loaded")
"""


@pytest.mark.torchrun
@needs_torchrun
def test_a_replica_that_fails_to_load_stops_every_rank_with_its_rank_and_reason(tiny, tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(FLAKY_SCRIPT))
    launched = run_python(torchrun(str(script), str(tiny)))  # a hang would reach the hang guard
    assert launched.returncode != 0
    assert "loaded" not in launched.stdout
    for rank in (0, 1):
        assert f"rank {rank} stopped: Replica load failed on rank 1 (node 0, local rank 1) on the CPU: " \
               "MemoryError: no room for the transformer on this rank" in launched.stdout


def test_one_process_is_one_replica_with_every_input(tiny, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with load_replica(tiny, PROMPTS, progress=False) as replica:
        assert isinstance(replica.pipe, diffusers.FluxPipeline)
        assert replica.share == list(enumerate(PROMPTS))
        assert replica.group is None and not replica.launch.distributed
        assert replica.gather(["x"]) == ["x"]


def test_launch_reads_torchruns_environment(monkeypatch):
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = Launch.from_env()
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, launch.node) == (5, 8, 1, 4, 1)
    assert launch.distributed and launch.label == "rank 5 (node 1, local rank 1)"


def test_run_with_no_prompt_is_an_error_without_traceback(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(["run", "tiny-flux", "--prompts", str(empty), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has no prompt" in err and "Traceback" not in err
