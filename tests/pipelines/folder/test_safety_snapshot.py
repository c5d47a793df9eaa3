"""A load is a snapshot of one save, even while another process saves over the folder (issue 12)."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from own_fixtures import TinyUserPipeline, tiny_user_pipeline

from child_process import hang_guard
from pipelines.errors import FolderChangedError
from pipelines.folder import model_index as snapshot

LOADS = 3  # loads that overlap at least SAVES saves: the test ends then, however fast the machine
SAVES = 3
SAVE_PAUSE = 0.02  # between saves: gives loads a chance to finish (they still overlap saves most of the time)


def _save_repeatedly(folder: str, stop, saves) -> None:
    """Save the pipeline again and again, every weight of save k equal to k."""
    pipe = tiny_user_pipeline()
    number = 0
    while not stop.is_set():
        number += 1
        with torch.no_grad():
            for module in pipe.module_components.values():
                for parameter in module.parameters():
                    parameter.fill_(number)
        pipe.save_pretrained(folder)
        saves.value = number
        time.sleep(SAVE_PAUSE)


def _save_numbers(pipe) -> set[float]:
    """The save each component's weights come from (all weights of save k are k)."""
    return {float(next(module.parameters()).detach().flatten()[0]) for module in pipe.module_components.values()}


@pytest.mark.parametrize("device_map", [None, "cpu"])
def test_loads_concurrent_with_saves_never_mix_two_saves(tmp_path, device_map):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    context = multiprocessing.get_context("fork")
    stop, saves = context.Event(), context.Value("i", 0)
    saver = context.Process(target=_save_repeatedly, args=(str(folder), stop, saves), daemon=True)
    saver.start()
    loaded, refused, mixed = 0, 0, []
    deadline = time.monotonic() + hang_guard()  # only a hang ends the loops below early
    try:
        while saves.value < 2 and time.monotonic() < deadline:  # the saver is up and saving
            time.sleep(0.01)
        first_save = saves.value
        # Load until LOADS loads overlapped at least SAVES saves, however long that takes on this machine.
        while time.monotonic() < deadline and (loaded + refused < LOADS or saves.value - first_save < SAVES):
            try:
                pipe = TinyUserPipeline.from_pretrained(folder, device_map=device_map, progress=False)
            except FolderChangedError:
                refused += 1
                continue
            numbers = _save_numbers(pipe)
            loaded += 1
            if len(numbers) != 1:
                mixed.append(sorted(numbers))
        saves_during = saves.value - first_save
    finally:
        stop.set()
        saver.join(timeout=20)
    # Never a mix; a load that kept being overtaken by saves may refuse clearly (FolderChangedError) instead.
    assert mixed == [], f"{len(mixed)} of {loaded} loads mixed saves, e.g. {mixed[:3]}"
    assert loaded + refused >= LOADS and saves_during >= SAVES, f"hung? {(loaded, refused, saves_during)}"


def test_a_load_overtaken_by_one_save_is_read_again(tmp_path, monkeypatch):
    folder = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(folder)
    versions = iter(["first", "second", "second", "second"])  # a save lands during the first attempt
    monkeypatch.setattr(snapshot, "folder_version", lambda path: next(versions))
    discarded, attempts = [], []

    def read():
        attempts.append(1)
        return len(attempts)

    assert snapshot.read_snapshot(folder, read, discard=discarded.append) == 2
    assert discarded == [1]


def test_a_load_retries_when_the_folder_changes_under_it_and_then_gives_up_clearly(tmp_path, monkeypatch):
    folder = tmp_path / "pipe"
    tiny_user_pipeline().save_pretrained(folder)
    versions = iter(range(1000))
    monkeypatch.setattr(snapshot, "folder_version", lambda path: next(versions))  # a save lands every time
    monkeypatch.setattr(snapshot, "_pause", lambda attempt: None)
    with pytest.raises(FolderChangedError, match=f"{snapshot.ATTEMPTS} times in a row"):
        TinyUserPipeline.from_pretrained(folder)


def test_an_error_on_a_folder_that_did_not_change_is_not_retried(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(snapshot, "folder_version", lambda path: calls.append(path) or "same")
    with pytest.raises(OSError, match="boom"):
        snapshot.read_snapshot(tmp_path, lambda: (_ for _ in ()).throw(OSError("boom")))
    assert len(calls) == 2  # before and after one attempt
