"""A quantization config, in a folder's config.json or given as an argument, is checked by its owner's config
class before anything is built: what the owner would not apply as asked (a string, an unknown quant_method, a
method whose library is missing, a field missing, contradictory fields) is one LoadError line
naming the component, the field and the accepted values, for a plan and for every kind of load; never ignored
(a string quantization_config loaded the model dense)."""

from __future__ import annotations

import json

import pytest

import pipelines
from pipelines import LoadError, Pipeline

from pipeline_fixtures import save_preset
from quantized_models import diffusers, save_flux, save_t5

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for", "ignore::FutureWarning")
BUDGETS = {0: "1GiB", "cpu": "1GiB"}

# config.json's quantization_config -> words the refusal must hold (beside the component), for both owners
REFUSED = {
    "a string": ("int8", ["quantization_config is 'int8', not a quantization config", "'quant_method' one of",
                          "'torchao'"]),
    "an unknown method": ({"quant_method": "int3"}, ["quant_method='int3'", "accepted values are", "'torchao'"]),
    "torchao without its type": ({"quant_method": "torchao"}, ["no 'quant_type' field", "Int8WeightOnlyConfig"]),
    "both bitsandbytes flags": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True},
                                ["load_in_4bit and load_in_8bit are both True", "only one"]),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {"diffusers": save_flux(root), "transformers": save_t5(root)}


def with_quantization(folder, value):
    path = folder / "config.json"
    original = path.read_text()
    path.write_text(json.dumps({**json.loads(original), "quantization_config": value}))
    return original


@pytest.mark.parametrize("owner", ["diffusers", "transformers"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_folder_config_the_owner_cannot_apply_is_refused_for_plans_and_loads(dense, owner, case):
    value, words = REFUSED[case]
    folder = dense[owner]
    original = with_quantization(folder, value)
    try:
        for attempt in (lambda: pipelines.plan_model(folder, max_memory=BUDGETS),
                        lambda: pipelines.load_model(folder, device_map="cpu", progress=False),
                        lambda: pipelines.load_model(folder, device_map=None, progress=False)):
            with pytest.raises(LoadError) as raised:
                attempt()
            message = str(raised.value)
            assert "\n" not in message and message.startswith("Component '")
            assert all(word in message for word in [*words, "config.json' quantization_config"]), message
    finally:
        (folder / "config.json").write_text(original)


def test_a_method_whose_library_is_missing_is_named_with_what_to_install(dense):
    folder = dense["transformers"]
    original = with_quantization(folder, {"quant_method": "gptq", "bits": 4})
    try:
        with pytest.raises(LoadError, match=r"'T5EncoderModel': quant_method='gptq' needs a library "
                                                          r"that is not installed \(No module named"):
            pipelines.plan_model(folder, max_memory=BUDGETS)
    finally:
        (folder / "config.json").write_text(original)


def test_a_config_dict_given_for_one_model_is_checked_not_ignored(dense):
    with pytest.raises(LoadError, match=r"quantization_config= has quant_method='int3'"):
        pipelines.plan_model(dense["diffusers"], max_memory=BUDGETS, quantization_config={"quant_method": "int3"})
    torchao = pytest.importorskip("torchao.quantization")
    as_dict = diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig()).to_dict()
    plan = pipelines.plan_model(dense["diffusers"], max_memory=BUDGETS, quantization_config=as_dict)
    assert "(torchao)" in next(iter(plan.components.values())).dtype


def test_a_config_dict_for_a_whole_pipeline_must_name_its_components(tmp_path):
    folder = save_preset(tmp_path / "tiny-flux")[0]
    with pytest.raises(LoadError, match="must say which components it quantizes"):
        Pipeline.plan_placement(folder, quantization_config={"quant_method": "torchao"})

