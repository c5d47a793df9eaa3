"""A load whose device_map names a GPU this machine lacks ("cuda:0", 0, {"": "cuda:0"}, a pin) is an error that
says so before anything is read, never a silent load onto the CPU; virtual accelerators count as GPUs; a strategy
name still runs on the CPU with its one warning, and planning for absent GPUs still works."""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines import Pipeline
from placement.errors import InvalidDeviceError

from pipeline_fixtures import module_components, save_preset

NO_GPU = r"asks for GPU 0 \(no GPU for 'cuda:0'\), but this machine has no accelerator"
ASKED = ["cuda:0", 0, torch.device("cuda", 0), {"": "cuda:0"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("requested") / "tiny-flux")[0]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "0")


@pytest.mark.parametrize("device_map", ASKED + [{"vae": 0}, {"transformer": {"transformer_blocks.0": "cuda:0", "": "cpu"}}])
def test_a_pipeline_load_onto_an_absent_gpu_is_an_error(folder, no_gpu, device_map):
    with pytest.raises(InvalidDeviceError, match=NO_GPU + r".*device_map='cpu'.*PLACEMENT_VIRTUAL_ACCELERATORS"):
        Pipeline.from_pretrained(folder, device_map=device_map, progress=False)


@pytest.mark.parametrize("device_map", ASKED)
def test_a_model_load_onto_an_absent_gpu_is_an_error(folder, no_gpu, device_map):
    for model in ("transformer", "text_encoder"):  # a diffusers model and a transformers one
        with pytest.raises(InvalidDeviceError, match=NO_GPU):
            pipelines.load_model(folder / model, device_map=device_map, progress=False)


def test_place_onto_an_absent_gpu_is_an_error_and_moves_nothing(folder, no_gpu):
    pipe = Pipeline.from_pretrained(folder, progress=False)
    with pytest.raises(InvalidDeviceError, match=NO_GPU):
        pipelines.place(pipe, device_map="cuda:0")
    assert getattr(pipe, "hf_device_map", None) is None


def test_a_gpu_beyond_those_present_is_named_with_the_ones_there(folder, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    with pytest.raises(InvalidDeviceError, match=r"asks for GPU 1 .*has 1 accelerator\(s\): GPU 0"):
        Pipeline.from_pretrained(folder, device_map="cuda:1", progress=False)


@pytest.mark.parametrize("device_map", ASKED)
def test_virtual_accelerators_count_as_gpus(folder, monkeypatch, device_map):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    pipe = Pipeline.from_pretrained(folder, device_map=device_map, progress=False)
    assert set(pipe.placement_plan.device_map.values()) == {0}
    assert {str(t.device) for module in module_components(pipe).values() for t in module.parameters()} == {"vgpu:0"}


def test_a_strategy_still_degrades_to_the_cpu_and_planning_for_absent_gpus_works(folder, no_gpu):
    with pytest.warns(UserWarning, match="degrades to 'cpu'"):
        pipe = Pipeline.from_pretrained(folder, device_map="balanced", progress=False)
    assert set(pipe.hf_device_map.values()) == {"cpu"}
    plan = Pipeline.plan_placement(folder, device_map="cuda:0", max_memory={0: "1GiB"})
    assert set(plan.device_map.values()) == {0}
