"""`quantization_config=` as diffusers users pass it, and the mistakes it must name: a mapping or a
PipelineQuantizationConfig naming no module component, one config for a whole pipeline, a config of the wrong
library, a component passed in."""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines import Pipeline

from pipeline_fixtures import save_preset
from quantized_models import save_t5

diffusers = pytest.importorskip("diffusers")
torchao = pytest.importorskip("torchao.quantization")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("options") / "tiny-flux")[0]


def int8():
    return diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig())


def test_a_mapping_naming_no_component_is_refused_with_the_components(folder):
    with pytest.raises(pipelines.LoadError, match=r"names \['unet'\].*'transformer'"):
        Pipeline.plan_placement(folder, quantization_config={"unet": int8()})
    pipeline_config = diffusers.PipelineQuantizationConfig(quant_mapping={"prior": int8()})
    with pytest.raises(pipelines.LoadError, match=r"names \['prior'\]"):
        Pipeline.plan_placement(folder, quantization_config=pipeline_config)


def test_one_config_for_a_whole_pipeline_must_say_which_components(folder):
    with pytest.raises(pipelines.LoadError, match="PipelineQuantizationConfig"):
        Pipeline.plan_placement(folder, quantization_config=int8())


def test_a_passed_component_is_placed_as_it_is(folder):
    transformer = pipelines.load_model(folder / "transformer", device_map=None, progress=False)
    with pytest.raises(pipelines.LoadError, match=r"names \['transformer'\], which were passed in"):
        Pipeline.plan_placement(folder, quantization_config={"transformer": int8()}, transformer=transformer)


def test_a_config_of_the_other_library_is_named(tmp_path):
    folder = save_t5(tmp_path)
    with pytest.raises(pipelines.LoadError,
                       match="transformers model but its quantization config is diffusers' TorchAoConfig"):
        pipelines.plan_model(folder, quantization_config=int8(), torch_dtype=torch.bfloat16, max_memory={0: "1GiB"})
