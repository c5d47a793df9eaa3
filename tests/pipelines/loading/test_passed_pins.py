"""Pinning means what the user meant: a component passed in stays where its own map puts weights on an
accelerator (or when named in `pin=`); the `{'': 'cpu'}` map diffusers leaves on `from_single_file` models and on
CPU `device_map="auto"` loads is placed like any other component, and the plan says so in one line."""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines import Pipeline

from pipeline_fixtures import generate, save_preset
from same_output import assert_same_output


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder, pipe = save_preset(tmp_path_factory.mktemp("pins") / "tiny-flux")
    return folder, generate(pipe)


def _transformer_loaded_by_default(folder):
    transformer = pipelines.load_model(folder / "transformer", device_map=None, progress=False)
    transformer.hf_device_map = {"": "cpu"}  # what diffusers' from_single_file / a CPU "auto" load leaves behind
    return transformer


def test_a_cpu_map_from_a_default_load_is_placed_like_the_others(two_gpus, saved):
    folder, expected = saved
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                               transformer=_transformer_loaded_by_default(folder), progress=False)
    plan = pipe.placement_plan
    assert plan.components["transformer"].execution_device in (0, 1) and not plan.components["transformer"].pinned
    assert {t.device.type for t in pipe.transformer.parameters()} == {"vgpu"}
    notes = [note for note in plan.warnings if "passed in with hf_device_map" in note]
    assert len(notes) == 1 and "transformer" in notes[0] and "placed like the other components" in notes[0]
    assert_same_output(generate(pipe), expected)


def test_pin_keeps_a_passed_component_where_it_is(two_gpus, saved):
    folder, expected = saved
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                               transformer=_transformer_loaded_by_default(folder), pin=["transformer"],
                                               progress=False)
    component = pipe.placement_plan.components["transformer"]
    assert component.pinned and component.execution_device == "cpu"
    assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}
    assert_same_output(generate(pipe), expected)


def test_a_map_on_an_accelerator_is_kept_there(two_gpus, saved):
    folder, expected = saved
    transformer = pipelines.load_model(folder / "transformer", device_map=1, progress=False)
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                               transformer=transformer, progress=False)
    assert pipe.placement_plan.components["transformer"].pinned
    assert pipe.placement_plan.components["transformer"].device_map == {"": 1}
    assert_same_output(generate(pipe), expected)


def test_pin_names_only_components_passed_in(saved):
    folder, _ = saved
    with pytest.raises(pipelines.LoadError, match=r"pin=\['vae'\] names \['vae'\], which were not passed"):
        Pipeline.plan_placement(folder, max_memory={0: "1GiB"}, pin=["vae"])


def test_a_passed_component_planned_partly_on_disk_is_served_from_the_offload_folder(two_gpus, saved, tmp_path):
    """The planner plans the disk for a component passed in as for any other (an offload_folder given); the load
    writes its disk entries there and serves them, as for a component its owner reads. Before, the plan was made
    and then refused by the loader. reset_device_map() gives the caller the whole module back, on the CPU."""
    folder, expected = saved
    plan = Pipeline.plan_placement(folder, max_memory={0: "8GiB", "cpu": "8GiB"})
    weights = sum(component.bytes for component in plan.components.values())
    transformer = _transformer_loaded_by_default(folder)
    before = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    # GPU 0 a little more than the transformer (the largest component) and the CPU a twentieth of the weights:
    # the rest of the weights, part of the transformer's among them, must go to disk.
    gpu = int(1.1 * plan.components["transformer"].bytes)
    pipe = Pipeline.from_pretrained(
        folder, device_map="balanced", max_memory={0: f"{gpu}B", "cpu": f"{int(0.05 * weights)}B"},
        offload_folder=tmp_path / "offload", transformer=transformer, progress=False)
    component = pipe.placement_plan.components["transformer"]
    assert "disk" in component.devices and component.execution_device == 0 and pipe.transformer is transformer
    assert list((tmp_path / "offload" / "transformer").glob("*.safetensors"))
    assert_same_output(generate(pipe), expected)
    pipe.reset_device_map()
    after = transformer.state_dict()
    assert all(tensor.device.type == "cpu" for tensor in after.values())
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
