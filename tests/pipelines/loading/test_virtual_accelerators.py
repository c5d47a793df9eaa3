"""PLACEMENT_VIRTUAL_ACCELERATORS=N: the library sees N accelerators backed by the CPU, so a multi-GPU plan loads
and dispatches on a CPU machine exactly as on N GPUs (integer devices, splits and offloaded components hooked
as on a GPU) while the tensors live in RAM, each on its virtual device (`vgpu:k`, strict: see
tests/placement/test_strict_virtual_accelerators.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hooks.hook_utils import hooks_of
from hooks.input_moving import MoveInputsHook
from hooks.residency import ResidencyHook
from pipelines import Pipeline
from placement.budgets import apply_accelerator_margin, detect_budgets
from placement.devices import accelerators_present, detect_accelerators, torch_device
from placement.errors import InvalidDeviceError

from pipeline_fixtures import generate, has_hooks, holds_no_copy, module_components, save_preset
from same_output import assert_same_output

# Budgets, as fractions of the pipeline's weights, under which tiny-flux's "sequential" plan uses every placement
# kind at once (the middle of a region found by a grid search over the plan, weights only): the transformer (64%
# of the weights) split over both GPUs, a component whole, one offloaded (RAM, run on a GPU) and one that no
# longer fits RAM: disk. ("balanced" keeps blocks of each resident instead, issue 18, so it does not show every
# kind at once.)
EVERY_KIND_FRACTIONS = {0: 0.5, 1: 0.45, "cpu": 0.2}
EVERY_KIND_STRATEGY = "sequential"


def every_kind(folder) -> dict:
    """EVERY_KIND_FRACTIONS of the weights the planner counts in `folder`, as max_memory."""
    plan = Pipeline.plan_placement(folder, max_memory={0: "8GiB", "cpu": "8GiB"})
    weights = sum(component.bytes for component in plan.components.values())
    return {device: f"{int(fraction * weights)}B" for device, fraction in EVERY_KIND_FRACTIONS.items()}


@pytest.fixture
def virtual(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-flux saved once, with the images diffusers' own CPU pipeline makes."""
    folder, pipe = save_preset(tmp_path_factory.mktemp("virtual") / "tiny-flux")
    return folder, generate(pipe)


def load(folder, **kwargs):
    return Pipeline.from_pretrained(folder, device_map="balanced", progress=False, **kwargs)


def hook_counts(module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, submodule in module.named_modules():
        for hook in hooks_of(submodule):
            counts[type(hook).__name__] = counts.get(type(hook).__name__, 0) + 1
    return counts


def test_the_library_sees_n_cpu_backed_accelerators(virtual, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")
    assert accelerators_present() == 2 and detect_accelerators().virtual
    assert torch_device(1) == torch.device("vgpu", 1) and torch_device("cuda:0") == torch.device("vgpu", 0)
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "0")  # the escape hatch: every virtual accelerator is the CPU
    assert torch_device(1) == torch.device("cpu") and accelerators_present() == 2
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "maybe")
    with pytest.raises(InvalidDeviceError, match="PLACEMENT_VIRTUAL_STRICT='maybe'"):
        torch_device(1)
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")
    budgets = detect_budgets()
    assert budgets.accelerators == (0, 1) and all(budgets.limit(d) > 0 for d in (0, 1, "cpu"))
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "two")
    with pytest.raises(InvalidDeviceError, match="PLACEMENT_VIRTUAL_ACCELERATORS='two'"):
        accelerators_present()


def test_balanced_over_two_virtual_gpus_is_device_mapped_with_ints_and_matches(virtual, saved):
    folder, expected = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "No accelerator" degrade: the accelerators are there
        pipe = load(folder, max_memory={0: "1GiB", 1: "1GiB"})
    assert set(pipe.hf_device_map.values()) == {0, 1}
    assert all(isinstance(device, int) for device in pipe.hf_device_map.values())
    assert_same_output(generate(pipe), expected)
    for name, module in module_components(pipe).items():
        assert hook_counts(module) == {"MoveInputsHook": 1}, name  # whole: one hook at its top, none below
        assert isinstance(module._hf_hook, MoveInputsHook)
        assert module._hf_hook.execution_device == torch_device(pipe.hf_device_map[name])
        assert {tensor.device for tensor in [*module.parameters(), *module.buffers()]} == {
            torch_device(pipe.hf_device_map[name])}
    pipe.reset_device_map()
    assert not has_hooks(pipe)


def test_detected_budgets_plan_onto_the_virtual_gpus(virtual, saved):
    folder, _ = saved
    plan = Pipeline.plan_placement(folder)
    assert plan.accelerators == [0, 1]
    assert all(component.kind.value == "whole" for component in plan.components.values())


def test_whole_split_offloaded_and_disk_in_one_load_match_the_plain_run(virtual, saved, tmp_path):
    folder, expected = saved
    pipe = Pipeline.from_pretrained(folder, device_map=EVERY_KIND_STRATEGY, progress=False,
                                    max_memory=every_kind(folder), offload_folder=tmp_path / "offload")
    plan = pipe.placement_plan
    kinds = {name: component.kind.value for name, component in plan.components.items()}
    assert sorted(kinds.values()) == ["disk", "offloaded", "split", "whole"]
    by_kind = {kind: name for name, kind in kinds.items()}
    assert_same_output(generate(pipe), expected)

    split = pipe.components[by_kind["split"]]
    assert set(split.hf_device_map.values()) == {0, 1}
    entries = [module for key, module in split.named_modules() if key in split.hf_device_map]
    # The top, then one per entry, except a container entry (a ModuleList the parent loops over, never called
    # itself): one on each of its blocks, where the inputs arrive.
    called = sum(len(module) if isinstance(module, torch.nn.ModuleList) else 1 for module in entries)
    # It executes on GPU 0, where the offloaded and disk ones load modules per call: per-call residency runs it
    # too (its phase may need their room), its one hook at the top a `ResidencyHook`. A piece of its rest that
    # runs on the other GPU hands its outputs back to GPU 0, where the code after it runs (`HandBackHook`).
    counts = hook_counts(split)
    assert counts.pop("ResidencyHook") == 1 and set(counts) <= {"MoveInputsHook", "HandBackHook"}
    assert sum(counts.values()) == called
    assert {f"{by_kind['split']}.{key}" for key in split.hf_device_map} <= set(pipe.hf_device_map)
    assert all(isinstance(device, int) for device in split.hf_device_map.values())

    assert hook_counts(pipe.components[by_kind["whole"]]) == {"ResidencyHook": 1}  # on GPU 0 too: one hook
    offloaded = pipe.components[by_kind["offloaded"]]
    # Offloaded with a transfer plan (issue 18): per-call residency runs it, one hook at its top and one on each
    # streamed block.
    assert plan.components[by_kind["offloaded"]].transfer.streamed_modules
    assert set(hook_counts(offloaded)) == {"ResidencyHook", "StreamedBlockHook"}
    assert isinstance(offloaded._hf_hook, ResidencyHook)
    assert offloaded._hf_hook.execution_device == torch_device(plan.components[by_kind["offloaded"]].execution_device)
    # Homed on disk: per-call residency reads its per-call and streamed modules from the checkpoint's own files
    # (no copy written to the offload folder: at most links pinning them); no weight of it is held in host RAM.
    disk = pipe.components[by_kind["disk"]]
    transfer = plan.components[by_kind["disk"]].transfer
    assert set(hook_counts(disk)) == {"ResidencyHook", "StreamedBlockHook"} and transfer.streamed_modules
    assert not any(p.device.type == "cpu" for p in disk.parameters())
    assert holds_no_copy(tmp_path / "offload", folder)

    pipe.reset_device_map()
    assert not has_hooks(pipe)
    assert_same_output(generate(pipe), expected)


def test_apple_mps_counts_as_one_accelerator_dispatched_as_mps(monkeypatch):
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 8 * 1024**3)
    assert accelerators_present() == 1 and detect_accelerators().kind == "mps"
    assert torch_device(0) == torch.device("mps")
    budgets = detect_budgets()  # planned onto it, not silently onto the CPU
    assert budgets.accelerators == (0,) and budgets.limit(0) == apply_accelerator_margin(8 * 1024**3)
