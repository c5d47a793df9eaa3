"""The `placement` command in a new user's first hour and `placement run`'s output folder (issue 30): argument
mistakes answered in one line with their real cause, checked before any plan; the likeliest fix first; one run per
--out; a full disk, a crash between an image and run.json, and file modes."""

from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path

from cases_calls import CLI, cli
from catalogue import Case

GIB = 2**30
RUN = ("run", "{tmp}/tiny-flux", "--prompts", "{tmp}/prompts.txt", "--height", "64", "--width", "64", "--steps", "1")


def with_tiny_flux(*argv: str, before=None, patch=None):
    """`placement ARGV` after copying the tiny-flux preset to {tmp}/tiny-flux and two prompts to {tmp}/prompts.txt;
    `before(tmp)` runs first, `patch(tmp)` is a context manager held around the command."""
    def run(tmp: Path):
        from bad_input_models import tiny_flux_preset

        tiny_flux_preset(tmp / "tiny-flux")
        (tmp / "prompts.txt").write_text("a lighthouse\na red fox\n")
        if before is not None:
            before(tmp)
        with (patch(tmp) if patch is not None else _nothing()):
            return cli(*argv)(tmp)
    return run


@contextmanager
def _nothing():
    yield


@contextmanager
def _patched(owner, name: str, value):
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


def _made_once(tmp: Path) -> None:
    cli(*RUN, "--out", "{tmp}/images")(tmp)


def _listed(tmp: Path) -> list[str]:
    return [image["file"] for image in json.loads((tmp / "images" / "run.json").read_text())["images"]]


def _lose_the_last_record(tmp: Path) -> None:
    """What a run killed between writing 00001.png and recording it leaves (plus its temporary file)."""
    _made_once(tmp)
    run_json = tmp / "images" / "run.json"
    content = json.loads(run_json.read_text())
    content["images"] = content["images"][:1]
    run_json.write_text(json.dumps(content))
    (tmp / "images" / ".00001.png.4242.dead.tmp").write_bytes(b"half an image")


def _not_repaired(tmp: Path) -> bool:
    left = sorted(p.name for p in (tmp / "images").iterdir())
    modes = {(tmp / "images" / name).stat().st_mode & 0o777 for name in left}
    return _listed(tmp) != ["00000.png", "00001.png"] or left != ["00000.png", "00001.png", "run.json"] or \
        modes != {0o666 & ~_umask()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _disk_full_at_the_second_record(tmp: Path):
    real, calls = os.fsync, []

    def fsync(fd):  # image 0, run.json, image 1, then run.json
        calls.append(fd)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    return _patched(os, "fsync", fsync)


def _held_by_another_run(tmp: Path):
    from pipelines.distributed.images import run_lock

    return run_lock(tmp / "images", wait=False)


def _hub_is_recorded(tmp: Path):
    import huggingface_hub

    def snapshot_download(*args, **kwargs):
        (tmp / "hub-asked").write_text("the Hub was asked")
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    return _patched(huggingface_hub, "snapshot_download", snapshot_download)


@contextmanager
def _a_16_gib_laptop(tmp: Path):
    """No accelerator, 16 GiB of RAM, whatever this machine has."""
    import accelerate.utils

    import pipelines.cli.advice
    import placement.budgets
    from placement.devices import Accelerators

    none = Accelerators(count=0, kind="cuda")
    with _patched(accelerate.utils, "get_max_memory", lambda: {"cpu": 16 * GIB}), \
            _patched(placement.budgets, "detect_accelerators", lambda: none), \
            _patched(pipelines.cli.advice, "accelerators_present", lambda: 0):
        yield


@contextmanager
def _no_accelerator(tmp: Path):
    """No CUDA, XPU or MPS device and no PLACEMENT_VIRTUAL_ACCELERATORS, whatever this machine has."""
    import pipelines.distributed.replica
    from placement.devices import Accelerators

    with _patched(pipelines.distributed.replica, "detect_accelerators", lambda: Accelerators(count=0, kind="cuda")):
        yield


def _hub_checked(tmp: Path, target: str):
    with _hub_is_recorded(tmp):
        return cli("plan", target)(tmp)


def _laptop_plan(tmp: Path):
    with _a_16_gib_laptop(tmp):
        return cli("plan", "flux")(tmp)


CASES = [
    Case(name="cli: run --out that is a regular file", run=with_tiny_flux(*RUN, "--out", "{tmp}/prompts.txt"),
         error=CLI, words=("--out", "prompts.txt", "is a file, not a folder"),
         harm=lambda tmp: (tmp / "prompts.txt").read_text() != "a lighthouse\na red fox\n"),
    Case(name="cli: run --out below a regular file", run=with_tiny_flux(*RUN, "--out", "{tmp}/prompts.txt/images"),
         error=CLI, words=("prompts.txt", "is a file, not a folder")),
    Case(name="cli: run with another --seed into a finished folder",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", "--seed", "5", before=_made_once),
         error=CLI, words=("seed 0 (now 5)", "--overwrite")),
    Case(name="cli: run into a folder another run is writing",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", patch=_held_by_another_run),
         error=CLI, words=("another placement run", f"pid {os.getpid()}", "--wait")),
    Case(name="cli: run whose disk fills up while recording an image",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", patch=_disk_full_at_the_second_record),
         error=CLI, words=("Cannot write", "run.json", "No space left on device", "kept"),
         harm=lambda tmp: _listed(tmp) != ["00000.png"]),
    Case(name="cli: run after a crash left an image out of run.json",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", before=_lose_the_last_record),
         error=None, harm=_not_repaired),
    Case(name="cli: run --prompts that is not UTF-8",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images",
                           before=lambda tmp: (tmp / "prompts.txt").write_bytes(b"un caf\xe9\n")),
         error=CLI, words=("not UTF-8", "line 1", "Save it as UTF-8")),
    Case(name="cli: plan --strength on a pipeline that does not start from an image",
         run=cli("plan", "tiny-flux", "--max-memory", "cpu=2GiB", "--height", "64", "--width", "64", "--strength", "0.5"),
         error=CLI, words=("--strength 0.5", "does not start from an image", "leave --strength out")),
    Case(name="cli: plan --steps 0", run=cli("plan", "tiny-flux", "--steps", "0"),
         error=CLI, words=("--steps", "0 is not 1 or more", "see 'placement plan --help'")),
    Case(name="cli: plan --steps alone plans at the pipeline's own size",
         run=cli("plan", "tiny-flux", "--max-memory", "2x8GiB,cpu=8GiB", "--steps", "28"), error=None,
         words=("height=256, width=256", "the pipeline's default")),
    Case(name="cli: plan without its target", run=cli("plan"),
         error=CLI, words=("required: target", "see 'placement plan --help'")),
    Case(name="cli: a negative device id in --max-memory", run=cli("plan", "tiny-flux", "--max-memory", "-1=24GiB"),
         error=CLI, words=("'-1' is negative", "numbered from 0")),
    Case(name="cli: ':' for '=' in --max-memory", run=cli("plan", "tiny-flux", "--max-memory", "0:24GiB"),
         error=CLI, words=("':'", "write 0=24GiB")),
    Case(name="cli: a strategy one letter short", run=cli("plan", "tiny-flux", "--strategy", "balance"),
         error=CLI, words=("'balance'", "did you mean 'balanced'")),
    Case(name="cli: a preset typed with '_'", run=lambda tmp: _hub_checked(tmp, "tiny_flux"),
         error=CLI, words=("'tiny_flux' is not a preset", "did you mean 'tiny-flux'"),
         harm=lambda tmp: (tmp / "hub-asked").exists()),
    Case(name="cli: plan --json into a folder", run=cli("plan", "tiny-flux", "--json", "{tmp}"),
         error=CLI, words=("--json", "is a folder; name a file")),
    Case(name="cli: plan flux on a machine without a GPU", run=lambda tmp: _laptop_plan(tmp),
         error=CLI, words=("Likeliest fixes first: (1)", "--dtype bf16 --max-memory 2x24GiB,cpu=64GiB",
                           "(2) Its weights must go to disk")),
    Case(name="cli: --version", run=cli("--version"), error=None),
    Case(name="cli: run a local folder that does not exist",
         run=cli("run", "{tmp}/no-such", "--prompts", "{pipe}/model_index.json", "--out", "{tmp}/images"),
         error=CLI, words=("No such folder", "no-such", "owner/name"), harm=lambda tmp: (tmp / "images").exists()),
    Case(name="cli: inspect a local folder that does not exist", run=cli("inspect", "./no-such-pipeline-folder"),
         error=CLI, words=("No such folder", "no-such-pipeline-folder")),
    Case(name="cli: run --max-memory 0=1GiB on a machine without a GPU",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", "--max-memory", "0=1GiB", patch=_no_accelerator),
         error=CLI, words=("--max-memory names GPU 0", "no accelerator", "would run on the CPU",
                           "only for cpu and disk", "PLACEMENT_VIRTUAL_ACCELERATORS=N"),
         harm=lambda tmp: (tmp / "images").exists()),
    Case(name="cli: plan a folder whose weights file was deleted",
         run=with_tiny_flux("plan", "{tmp}/tiny-flux", "--max-memory", "cpu=1GiB",
                           before=lambda tmp: (tmp / "tiny-flux" / "vae" / "diffusion_pytorch_model.safetensors").unlink()),
         error=CLI, words=("cannot load as it is", "vae: No weights in", "tiny-flux/vae",
                           "diffusion_pytorch_model.safetensors")),
]
