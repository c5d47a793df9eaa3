"""Saving our pipeline (tiny-dit) in every placement kind, before and after `reset_device_map()`, over two strict
virtual accelerators: each weight is read from where it lives (the placement does not change, nothing is moved),
the folder reloads to the same images, a failed save leaves the target as it was, and reset puts every component
back as it was, a component passed in included (so the next load pins it again)."""

from __future__ import annotations

import pytest
import torch

from hooks import dispatch, measure_transfers
from pipelines import TextToImagePipeline
from placement.devices import torch_device

from pipeline_fixtures import generate, has_hooks, save_preset
from placed_kinds import KINDS, hooks_and_placeholders, kind_plan
from same_output import assert_same_output, same_output

BUDGETS = {0: "1GiB", 1: "1GiB", "cpu": "4GiB"}
PARTS = {"text_encoder": ("layers", "embeddings"), "denoiser": ("double_blocks", "single_blocks")}


@pytest.fixture
def virtual(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-dit saved once, the in-memory pipeline it came from, and the images that one makes."""
    folder, pipe = save_preset(tmp_path_factory.mktemp("placed-saves") / "tiny-dit")
    return folder, pipe, generate(pipe)


def load(folder, **kwargs) -> TextToImagePipeline:
    return TextToImagePipeline.from_pretrained(folder, progress=False, **kwargs)


def reloads_to(folder, expected) -> bool:
    return same_output(generate(load(folder)), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_placed_pipeline_saves_as_it_is_in_every_kind_and_after_reset(virtual, saved, tmp_path, kind):
    folder, original, expected = saved
    plan = kind_plan(load_plan(folder), original.module_components, kind, PARTS)
    pipe = load(folder, device_map=plan)
    placed = hooks_and_placeholders(pipe.module_components)
    with measure_transfers() as meter:
        pipe.save_pretrained(tmp_path / "placed")
    assert meter.host_to_accelerator_bytes == 0  # nothing onloaded, served or streamed to save
    assert hooks_and_placeholders(pipe.module_components) == placed  # the placement is as it was
    assert_same_output(generate(pipe), expected)
    assert reloads_to(tmp_path / "placed", expected)

    pipe.reset_device_map()
    assert not has_hooks(pipe) and pipe.hf_device_map is None
    assert all(module.hf_device_map is None for module in pipe.module_components.values())  # ModelMixin's own
    assert {t.device.type for m in pipe.module_components.values() for t in m.state_dict().values()} == {"cpu"}
    pipe.save_pretrained(tmp_path / "reset")
    assert reloads_to(tmp_path / "reset", expected)


def load_plan(folder):
    return TextToImagePipeline.plan_placement(folder, max_memory=BUDGETS)


@pytest.mark.parametrize("technique", ["group-disk", "sequential"])
def test_after_reset_saving_reads_the_offload_techniques_stores(virtual, saved, tmp_path, technique):
    folder, _, expected = saved
    pipe = load(folder, device_map="balanced", max_memory=BUDGETS)
    pipe.reset_device_map()
    if technique == "group-disk":  # weights in one safetensors file per group, meta in the modules
        pipe.enable_group_offload(0, offload_to_disk_path=tmp_path / "groups")
    else:  # a CPU state dict served per layer, meta in the modules
        pipe.enable_sequential_cpu_offload(0)
    assert any(t.is_meta for m in pipe.module_components.values() for t in m.parameters())
    pipe.save_pretrained(tmp_path / "saved")
    assert any(t.is_meta for m in pipe.module_components.values() for t in m.parameters())
    assert reloads_to(tmp_path / "saved", expected)


def test_a_failure_mid_save_leaves_the_target_as_it_was(virtual, saved, tmp_path, monkeypatch):
    folder, original, _ = saved
    target = tmp_path / "target"
    original.save_pretrained(target)
    (target / "README.md").write_text("mine")
    before = tree(target)
    pipe = load(folder, device_map=kind_plan(load_plan(folder), original.module_components, "disk", PARTS))

    def fails(*args, **kwargs):
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(pipe.vae, "save_pretrained", fails)  # after text encoders and denoiser were written
    with pytest.raises(RuntimeError, match="the disk went away"):
        pipe.save_pretrained(target)
    assert tree(target) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["target"]  # no staging folder left behind


def tree(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_reset_gives_passed_in_components_back_and_a_second_load_pins_them_again(virtual, saved, tmp_path):
    folder, original, expected = saved

    def own_copy(name):  # a component the user loaded by itself, on the CPU
        return type(original.components[name]).from_pretrained(folder / name, progress=False)

    plain = own_copy("vae")  # on the CPU, not device-mapped
    owned = own_copy("text_encoder").to(torch_device(1))
    owned.hf_device_map = {"": 1}  # placed by its owner on accelerator 1, without hooks
    hooked = own_copy("text_encoder_2").to(torch_device(1))
    hooked.layers.to("cpu")
    dispatch(hooked, {"": 1, "layers": "cpu"})  # its owner's hooks, its layers served from CPU RAM
    hooked_state = hooks_and_placeholders({"text_encoder_2": hooked})
    passed = dict(vae=plain, text_encoder=owned, text_encoder_2=hooked)

    pipe = load(folder, device_map="balanced", max_memory=BUDGETS, **passed)
    assert pipe.placement_plan.components["text_encoder"].pinned and pipe.hf_device_map["text_encoder"] == 1
    assert_same_output(generate(pipe), expected)
    pipe.save_pretrained(tmp_path / "placed")  # text_encoder_2's layers read from its owner's hooks
    assert reloads_to(tmp_path / "placed", expected)

    pipe.reset_device_map()
    assert plain.hf_device_map is None and not has_hooks(plain)
    assert {t.device for t in plain.state_dict().values()} == {torch.device("cpu")}
    assert owned.hf_device_map == {"": 1} and not has_hooks(owned)
    assert {t.device for t in owned.state_dict().values()} == {torch_device(1)}
    assert hooks_and_placeholders({"text_encoder_2": hooked}) == hooked_state  # its owner's placement, untouched
    pipe.save_pretrained(tmp_path / "reset")
    assert reloads_to(tmp_path / "reset", expected)

    again = load(folder, device_map="balanced", max_memory=BUDGETS, **passed)
    pinned = {name for name, component in again.placement_plan.components.items() if component.pinned}
    assert pinned == {"text_encoder", "text_encoder_2"}
    assert_same_output(generate(again), expected)



@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["offloaded", "disk", "per_call"])
def test_on_the_gpu_a_placed_pipeline_saves_as_it_is(saved, tmp_path, kind):
    folder, original, expected = saved
    base = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB", "cpu": "4GiB"})
    pipe = load(folder, device_map=kind_plan(base, original.module_components, kind, PARTS))
    placed = hooks_and_placeholders(pipe.module_components)
    pipe.save_pretrained(tmp_path / "placed")
    assert hooks_and_placeholders(pipe.module_components) == placed
    assert_same_output(generate(load(tmp_path / "placed")), expected)
