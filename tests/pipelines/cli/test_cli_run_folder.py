"""`placement run`'s output folder as careless or unlucky users leave it: checked before any work, one run at a
time (refused with the holder's pid, or waited for), files with the umask's modes, run.json repaired from what a
stopped run left, write errors naming their path, and Ctrl-C at any moment one line that frees the folder."""

from __future__ import annotations

import errno
import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest

import pipelines.cli.advice
import pipelines.distributed
from pipelines.cli import main
from pipelines.distributed.images import LOCK_NAME, RunFolder, run_lock, write_atomically

from child_process import hang_guard

CALL = ["--height", "64", "--width", "64", "--steps", "1"]

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    import shutil

    from pipelines.presets.catalog import preset_folder

    folder = tmp_path_factory.mktemp("run") / "tiny-flux"
    shutil.copytree(preset_folder("tiny-flux"), folder)  # the preset's folder (seed 0), the test's own copy
    return folder


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("a lighthouse\na red fox\n")
    return path


@pytest.fixture
def never_plans(monkeypatch):
    """Any plan fails the test: what is checked must be checked before planning."""
    def plan(*args, **kwargs):
        raise AssertionError("planned before refusing")

    monkeypatch.setattr(pipelines.cli.advice, "plan_with_advice", plan)


def run(tiny: Path, prompts: Path, out: Path, *extra: str) -> int:
    return main(["run", str(tiny), "--prompts", str(prompts), "--out", str(out), *CALL, *extra])


def test_out_that_is_a_file_is_refused_before_anything_is_read(tiny, prompts, capsys, never_plans):
    assert run(tiny, prompts, prompts) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"--out {str(prompts)!r} is a file, not a folder" in err
    assert prompts.read_text() == "a lighthouse\na red fox\n"


def test_another_seed_into_a_finished_folder_is_refused_before_planning(tiny, prompts, tmp_path, capsys, monkeypatch):
    out = tmp_path / "images"
    assert run(tiny, prompts, out) == 0
    capsys.readouterr()
    monkeypatch.setattr(pipelines.cli.advice, "plan_with_advice", lambda *a, **k: pytest.fail("planned"))
    assert run(tiny, prompts, out, "--seed", "7") == 2
    assert "its run.json has seed 0 (now 7)" in capsys.readouterr().err


def test_a_second_run_into_a_folder_being_written_is_refused_with_the_holders_pid(tiny, prompts, tmp_path, capsys,
                                                                                   never_plans):
    out = tmp_path / "images"
    with run_lock(out, wait=False):
        assert (out / LOCK_NAME).read_text().strip() == str(os.getpid())
        assert run(tiny, prompts, out) == 2
    err = capsys.readouterr().err
    assert f"{str(out)!r} is being written by another placement run (pid {os.getpid()})" in err and "--wait" in err
    assert not out.exists()  # the holder made it and wrote nothing: nothing is left behind


class _Announced(io.StringIO):
    """stderr that sets `event` once the waiting line is written."""

    def __init__(self, event: threading.Event):
        super().__init__()
        self.event = event

    def write(self, text: str) -> int:
        if "Waiting for another placement run" in text:
            self.event.set()
        return super().write(text)


def test_wait_waits_for_the_holder_then_runs(tiny, prompts, tmp_path, monkeypatch, capsys):
    out = tmp_path / "images"
    held, waiting, done = threading.Event(), threading.Event(), threading.Event()

    def holder():
        with run_lock(out, wait=False):
            held.set()
            waiting.wait(hang_guard())
        done.set()

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(hang_guard())
    monkeypatch.setattr(sys, "stderr", _Announced(waiting))
    try:
        code = run(tiny, prompts, out, "--wait")
    finally:
        waiting.set()
        thread.join()
    assert code == 0 and done.is_set()
    assert f"Waiting for another placement run (pid {os.getpid()}) to finish writing into {out}" in sys.stderr.getvalue()
    assert sorted(p.name for p in out.iterdir()) == ["00000.png", "00001.png", "run.json"]


def test_files_get_the_umasks_mode_not_0600(tmp_path):
    previous = os.umask(0o022)
    try:
        write_atomically(tmp_path / "a.png", b"x")
        os.umask(0o077)
        write_atomically(tmp_path / "b.png", b"x")
    finally:
        os.umask(previous)
    assert (tmp_path / "a.png").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.png").stat().st_mode & 0o777 == 0o600


def test_a_full_disk_names_the_path_and_the_next_run_remakes_what_run_json_lacks(tiny, prompts, tmp_path, capsys,
                                                                                  monkeypatch):
    out = tmp_path / "images"
    real_fsync, calls = os.fsync, []

    def fills_up(fd):  # image 0, run.json, image 1, then run.json finds the disk full
        calls.append(fd)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fills_up)
    assert run(tiny, prompts, out) == 2
    err = capsys.readouterr().err
    assert f"Cannot write {str(out / 'run.json')!r}: No space left on device" in err and "Traceback" not in err
    listed = [image["file"] for image in json.loads((out / "run.json").read_text())["images"]]
    assert listed == ["00000.png"] and (out / "00001.png").is_file()  # on disk, not recorded
    (out / ".00001.png.99999.dead.tmp").write_bytes(b"half")  # what a kill -9 mid-write leaves

    monkeypatch.setattr(os, "fsync", real_fsync)
    assert run(tiny, prompts, out) == 0
    printed = capsys.readouterr().out
    assert f"1 image(s) in {out} are not in run.json (00001.png): a run stopped before recording them" in printed
    assert "1 image(s) made by 1 replica(s)" in printed and "1 already there" in printed
    assert sorted(p.name for p in out.iterdir()) == ["00000.png", "00001.png", "run.json"]
    assert [image["file"] for image in json.loads((out / "run.json").read_text())["images"]] == ["00000.png",
                                                                                                 "00001.png"]


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("moment", ["planning", "loading", "writing"])
def test_ctrl_c_at_any_moment_is_one_line_and_frees_the_folder(tiny, prompts, tmp_path, capsys, monkeypatch, moment):
    target = {"planning": (pipelines.cli.advice, "plan_with_advice"),
              "loading": (pipelines.distributed, "load_replica"),
              "writing": (RunFolder, "write")}[moment]
    monkeypatch.setattr(*target, _interrupt)
    out = tmp_path / "images"
    code = run(tiny, prompts, out)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("placement")]
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith("placement run: interrupted (Ctrl-C) before it finished; run the same command again")
    assert not out.exists() or LOCK_NAME not in os.listdir(out)
    monkeypatch.undo()
    assert run(tiny, prompts, out) == 0  # nothing held: the next run goes ahead


def _a_link_to(outside: Path):
    return lambda lock: lock.symlink_to(outside)


def _a_hard_link_to(outside: Path):
    return lambda lock: os.link(outside, lock)


@pytest.mark.parametrize("make, said", [(_a_link_to, "a symbolic link (to "), (_a_hard_link_to, "2 hard links"),
                                        (lambda outside: Path.mkdir, "is a folder")])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_and_nothing_outside_is_written(
        tiny, prompts, tmp_path, capsys, never_plans, make, said):
    """A symbolic link there used to be followed (the file it names truncated, the pid written into it); a folder
    there gave a raw IsADirectoryError."""
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    out = tmp_path / "images"
    out.mkdir()
    make(outside)(out / LOCK_NAME)
    assert run(tiny, prompts, out) == 2
    err = capsys.readouterr().err
    assert str(out / LOCK_NAME) in err and said in err
    assert "never opens anything else" in err and "choose another --out" in err and "Traceback" not in err
    assert outside.read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_records_in_out_replace_a_link_there_and_never_write_through_it(tmp_path):
    outside = tmp_path / "precious.json"
    outside.write_text("keep me")
    (tmp_path / "run.json").symlink_to(outside)
    write_atomically(tmp_path / "run.json", b"{}")
    assert outside.read_text() == "keep me" and not (tmp_path / "run.json").is_symlink()


def test_a_second_run_with_other_prompts_is_refused_instead_of_replacing_the_images(tiny, prompts, tmp_path, capsys):
    """A second `placement run --wait` with other prompts made image i again for its own prompt i, replacing the
    first run's without a word."""
    out = tmp_path / "images"
    assert run(tiny, prompts, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = tmp_path / "other.txt"
    other.write_text("a lighthouse\na blue whale\na third one\n")
    capsys.readouterr()
    assert run(tiny, other, out, "--wait") == 2
    err = capsys.readouterr().err
    assert "00001.png was made for 'a red fox' (now 'a blue whale')" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prompts.write_text("a lighthouse\na red fox\na third one\n")  # more prompts after the same ones: made, added
    assert run(tiny, prompts, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["00000.png", "00001.png", "00002.png", "run.json"]
    assert run(tiny, other, out, "--overwrite") == 0  # asked for: made again
