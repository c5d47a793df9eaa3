"""A placed pipeline whose denoiser is homed on disk reads it from the checkpoint at every call: it stays pinned to
the version it loaded while another thread saves over the folder (atomically), in every round of a race. Its
files are hard-linked into the offload folder at load; where no link can be made (another filesystem), each read
checks the file's identity and a changed, replaced, deleted or cut file fails the call with OffloadConflictError
naming it — never a mix of two versions, never a raw error. The denoiser homed on disk whole (accelerate's hooks
read it) and streamed per call (group offloading's checkpoint store). Over two strict virtual accelerators."""

from __future__ import annotations

import errno
import gc
import os
import threading
from pathlib import Path

import pytest

from hooks.errors import OffloadConflictError
from hooks.pinned_files import PINNED_PREFIX

from own_fixtures import USER_IDS, TinyUserPipeline, tiny_user_pipeline
from placed_kinds import kind_plan
from same_output import assert_same_output, same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")

DISK_DENOISER = {"denoiser": "disk", "encoder": 0, "decoder": 1}
ROUNDS = 20


@pytest.fixture(autouse=True)
def virtual(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture
def outputs():
    """What each version's pipeline computes in memory (float32 on the CPU)."""
    return {seed: tiny_user_pipeline(seed)(USER_IDS) for seed in (0, 1, 2)}


def per_call_plan(folder: Path):
    """The denoiser executed on GPU 0, its block 0 loaded from RAM per call and block 1 streamed from the disk
    (group offloading's checkpoint store, read ahead on a background thread)."""
    base = TinyUserPipeline.plan_placement(folder, max_memory={0: "1GiB", 1: "1GiB", "cpu": "1GiB"})
    denoiser = tiny_user_pipeline(0).denoiser
    return kind_plan(base, {"denoiser": denoiser}, "per_call", {"denoiser": ("blocks.0", "blocks.1")})


def load(folder: Path, offload: Path, *, links: bool, monkeypatch, per_call: bool = False) -> TinyUserPipeline:
    device_map = per_call_plan(folder) if per_call else DISK_DENOISER
    with monkeypatch.context() as patched:
        if not links:  # an offload folder on another filesystem: os.link fails with EXDEV
            def cross_device(*args, **kwargs):
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            patched.setattr(os, "link", cross_device)
        pipe = TinyUserPipeline.from_pretrained(folder, device_map=device_map, offload_folder=offload,
                                                progress=False)
    assert "disk" in pipe.hf_device_map.values()
    return pipe


def denoiser_file(folder: Path) -> Path:
    return next((folder / "denoiser").glob("*.safetensors"))


@pytest.mark.parametrize("per_call", [False, True], ids=["disk", "streamed-per-call"])
@pytest.mark.parametrize("links", [True, False], ids=["hard-linked", "checked-in-place"])
def test_every_round_of_a_race_with_saves_computes_the_loaded_version_or_raises(tmp_path, monkeypatch, outputs,
                                                                                   links, per_call):
    folder = tmp_path / "pipe"
    tiny_user_pipeline(0).save_pretrained(folder)
    pipe = load(folder, tmp_path / "offload", links=links, monkeypatch=monkeypatch, per_call=per_call)
    assert_same_output(pipe(USER_IDS), outputs[0])  # float32 on one CPU: the same sums
    others = {seed: tiny_user_pipeline(seed) for seed in (1, 2)}
    saving, results = threading.Event(), []

    def saver():
        saving.set()
        for round_number in range(ROUNDS):
            others[1 + round_number % 2].save_pretrained(folder)

    thread = threading.Thread(target=saver)
    thread.start()
    saving.wait()
    for _ in range(ROUNDS):
        try:
            results.append(pipe(USER_IDS))
        except OffloadConflictError as error:
            assert str(denoiser_file(folder)) in str(error) and "Load the pipeline" in str(error)
            results.append(None)
    thread.join()
    mixed = [index for index, result in enumerate(results)
             if result is not None and not same_output(result, outputs[0])]
    assert mixed == [], f"rounds {mixed} computed neither the loaded version nor raised"
    if links:  # pinned: the loaded version, every round and after the last save
        assert None not in results and same_output(pipe(USER_IDS), outputs[0])
    else:  # once a save replaced the file, every call says so
        with pytest.raises(OffloadConflictError, match="replaced or rewritten since the load"):
            pipe(USER_IDS)


@pytest.mark.parametrize("damage, said", [
    (lambda path: path.unlink(), "it is gone"),
    (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "bytes, [0-9]+ when loaded"),
    (lambda path: os.replace(denoiser_file(path.parents[3] / "other"), path), "replaced or rewritten"),
])
def test_a_deleted_cut_or_replaced_file_is_named_not_a_raw_error(tmp_path, monkeypatch, damage, said):
    folder = tmp_path / "run" / "pipe"
    tiny_user_pipeline(0).save_pretrained(folder)
    tiny_user_pipeline(1).save_pretrained(tmp_path / "other")
    pipe = load(folder, tmp_path / "offload", links=False, monkeypatch=monkeypatch)
    damage(denoiser_file(folder))
    with pytest.raises(OffloadConflictError, match=said) as raised:
        pipe(USER_IDS)
    assert "diffusion_pytorch_model.safetensors" in str(raised.value)


def test_the_links_go_with_the_pipeline_and_a_dead_process_leaves_none_behind(tmp_path, monkeypatch, outputs):
    folder, offload = tmp_path / "pipe", tmp_path / "offload"
    tiny_user_pipeline(0).save_pretrained(folder)
    (offload / f"{PINNED_PREFIX}999999999-deadbeef").mkdir(parents=True)  # left by a killed process
    pipe = load(folder, offload, links=True, monkeypatch=monkeypatch)
    pinned = [entry for entry in offload.iterdir() if entry.name.startswith(PINNED_PREFIX)]
    assert len(pinned) == 1 and str(os.getpid()) in pinned[0].name
    assert [link.stat().st_ino for link in pinned[0].iterdir()] == [denoiser_file(folder).stat().st_ino]
    pipe.reset_device_map()  # the weights come back from the pinned files, whole
    assert same_output(pipe(USER_IDS), outputs[0])
    del pipe
    gc.collect()
    assert [entry.name for entry in offload.iterdir()] == []


def test_a_file_saved_over_between_its_header_and_its_link_is_never_pinned_as_the_version_loaded(
        tmp_path, monkeypatch, outputs):
    """The identity is recorded before the header is read: a save landing before the link is made fails a model's
    load, and a pipeline's load (a snapshot of one save) is read again, whole, from the new version."""
    from own_fixtures import Denoiser

    folder, offload = tmp_path / "pipe", tmp_path / "offload"
    tiny_user_pipeline(0).save_pretrained(folder)
    real_link, saved = os.link, []

    def saved_over_first(source, destination, *args, **kwargs):
        if PINNED_PREFIX in str(destination) and not saved:  # the pin's link (the save links its carried entries)
            saved.append(True)
            tiny_user_pipeline(1).save_pretrained(folder)
        return real_link(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "link", saved_over_first)
    with pytest.raises(OffloadConflictError, match="replaced while the model was loading"):
        Denoiser.from_pretrained(folder / "denoiser", device_map={"": "disk"}, offload_folder=offload, progress=False)
    assert [entry.name for entry in offload.iterdir()] == []
    saved.clear()
    pipe = TinyUserPipeline.from_pretrained(folder, device_map=DISK_DENOISER, offload_folder=offload, progress=False)
    assert same_output(pipe(USER_IDS), outputs[1]) and len(saved) == 1
