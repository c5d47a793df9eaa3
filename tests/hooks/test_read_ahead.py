"""Disk-homed streamed blocks are read ahead on strict virtual accelerators: the read of block k+1 runs on the
reader thread and is issued before block k's compute ends (the trace says so); a recorder holds each read until
the block before it is computing, which only a read running beside that compute can wait for; the output is the
plain run's. Nothing here is timed: the order and the thread are the point (benchmarks/disk_read_ahead.py times
it)."""

import threading

import pytest
import safetensors.torch
import torch

from hooks import apply_plan, trace_calls
from hooks.group_offload.read_ahead import THREAD_NAME
from hooks.residency import StreamedBlockHook
from hooks.hook_utils import hooks_of
from placement.drawings import COMPUTE_END, COPY_ISSUED
from placement.plan_schema import PlacementKind
from transfer_pipeline import STEPS, assert_decoded, component, make, place_resident, plan, run

BLOCKS = [f"blocks.{i}" for i in range(6)]
STREAMED = ("blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5")
DENOISER_MAP = {"proj_in": 0, **{b: ("disk" if b in STREAMED else 0) for b in BLOCKS}, "norm": 0, "proj_out": 0}
GUARD_SECONDS = 120.0  # a hang guard only: a read that is not beside the compute waits for it in vain


@pytest.fixture
def placed(monkeypatch, tmp_path):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")
    modules = make()
    expected = run(modules)
    denoiser = modules["denoiser"]
    file = tmp_path / "denoiser.safetensors"
    weights = {name: tensor for name, tensor in denoiser.state_dict().items()
               if any(name.startswith(block + ".") for block in STREAMED)}
    safetensors.torch.save_file(weights, file)
    index = {name: {"safetensors_file": str(file), "weight_name": name, "dtype": "float32"} for name in weights}
    components = [component("encoder", modules["encoder"], {"": 0}),
                  component("denoiser", denoiser, DENOISER_MAP, streamed=STREAMED, runs=STEPS, activation_bytes=0,
                            kind=PlacementKind.DISK),
                  component("decoder", modules["decoder"], {"": 0})]
    resident = sum(c.placed_bytes.get(0, 0) for c in components)
    placement = plan(components, {0: resident + 20_000})
    for block in STREAMED:
        denoiser.get_submodule(block).to("meta")  # what the loader leaves for "disk" parameters
    place_resident(modules, placement)
    handles = apply_plan(modules, placement, disk_weights={"denoiser": index})
    yield modules, expected
    handles.remove()


def streamed_groups(denoiser):
    """block path -> its group (the streamed blocks' hooks hold them)."""
    groups = {}
    for path in STREAMED:
        for hook in hooks_of(denoiser.get_submodule(path)):
            if isinstance(hook, StreamedBlockHook):
                groups[path] = hook.group
    return groups


def hold_reads_until_the_block_before_computes(denoiser):
    """Each streamed block's read (but a run's first) waits until the streamed block before it is inside its
    forward (weights in place, computing); records (block, reading thread, whether the wait was met)."""
    computing = {path: threading.Event() for path in STREAMED}
    records = []
    for path, block_path in zip(STREAMED, STREAMED):
        denoiser.get_submodule(block_path).attn.register_forward_pre_hook(
            lambda module, args, path=path: computing[path].set())
    for index, (path, group) in enumerate(streamed_groups(denoiser).items()):
        read = group.store.read
        before = STREAMED[index - 1] if index else None

        def held_read(*args, read=read, path=path, before=before, **kwargs):
            met = True
            if before is not None:
                met = computing[before].wait(GUARD_SECONDS)
                computing[before].clear()
            records.append((path, threading.current_thread().name, met))
            return read(*args, **kwargs)

        group.store.read = held_read
    return records


def test_the_next_disk_block_is_read_on_the_reader_thread_while_the_one_before_computes(placed):
    modules, expected = placed
    denoiser = modules["denoiser"]
    run(modules)  # the first call learns the order the streamed blocks run in
    records = hold_reads_until_the_block_before_computes(denoiser)
    with trace_calls() as trace:
        output = run(modules)
    assert_decoded(output, expected)
    assert len(records) == STEPS * len(STREAMED)
    assert all(thread.startswith(THREAD_NAME) for _, thread, _ in records), records
    assert all(met for _, _, met in records), [r for r in records if not r[2]]
    events = [(e.kind, e.block) for e in trace.events if e.component == "denoiser" and e.block]
    for before, after in zip(STREAMED, STREAMED[1:]):
        issued = [i for i, event in enumerate(events) if event == (COPY_ISSUED, after)]
        ended = [i for i, event in enumerate(events) if event == (COMPUTE_END, before)]
        assert len(issued) == len(ended) == STEPS
        assert all(i < e for i, e in zip(issued, ended)), (before, after)


def test_a_disk_block_read_that_fails_raises_in_the_call(placed):
    modules, _ = placed
    run(modules)
    group = streamed_groups(modules["denoiser"])["blocks.3"]

    def broken(*args, **kwargs):
        raise OSError("the drive went away")

    group.store.read = broken
    with pytest.raises(OSError, match="the drive went away"):
        run(modules)
