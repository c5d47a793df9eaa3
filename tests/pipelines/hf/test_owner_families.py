"""transformers checkpoints saved by transformers 5 (tiny random models of the families diffusers pipelines use) load
through our planner as their own class, with outputs equal to transformers' own load: those whose keys
transformers renames on load (Qwen2.5-VL, Llava, Mistral3, Gemma3) are read by transformers with our plan's map,
the others streamed by our loader; each is planned at exactly the bytes it loads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import pipelines
from pipelines.folder.sources import family_of
from pipelines.loading.meta import WeightsReader, build_component
from placement.sizing import size_module

from transformers_families import FAMILIES, build, output_of
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")

# transformers 5 writes these under their original key names (it renames them when loading).
RENAMED = {"qwen2_5_vl", "llava", "mistral3", "gemma3"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    folders = {}
    for name in FAMILIES:
        model = build(name)
        model.save_pretrained(root / name)
        folders[name] = (root / name, type(model))
    return folders


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_loads_as_transformers_loads_it(saved, name):
    folder, cls = saved[name]
    meta = build_component(name, cls, folder, family=family_of(cls), dtype=None, variant=None, weights_required=True)
    assert meta.reader is (WeightsReader.OWNER if name in RENAMED else WeightsReader.STREAM)

    model = pipelines.load_model(folder, device_map="auto", progress=False)
    reference = cls.from_pretrained(folder).eval()
    assert type(model) is cls
    assert_same_output(output_of(model, name), output_of(reference, name))
    assert model.placement_plan.components[cls.__name__].bytes == size_module(reference).total
    assert model.hf_device_map == {"": "cpu"}


def _split_over_two(folder, cls, dtype):
    plan = pipelines.plan_model(folder, device_map="balanced", torch_dtype=dtype, max_memory={0: "1GiB", 1: "1GiB"})
    total = plan.components[cls.__name__].bytes
    budget = {0: f"{int(total * 0.7)}B", 1: f"{int(total * 0.7)}B"}  # neither GPU holds it whole
    return total, pipelines.load_model(folder, device_map="balanced", max_memory=budget, torch_dtype=dtype,
                                       progress=False)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava"])
def test_a_renamed_checkpoint_splits_over_two_virtual_gpus(saved, name, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    folder, cls = saved[name]
    total, model = _split_over_two(folder, cls, torch.float32)
    reference = cls.from_pretrained(folder, dtype=torch.float32).eval()
    assert set(model.hf_device_map.values()) == {0, 1}
    assert model.placement_plan.components[cls.__name__].bytes == size_module(reference).total == total
    # Ops on virtual devices may take other CPU kernels (attention) than on the plain CPU: fp32 rounding only.
    assert_same_output(output_of(model, name), output_of(reference, name))


@pytest.mark.parametrize("name", sorted(RENAMED))
def test_a_renamed_checkpoint_is_planned_in_bfloat16_as_transformers_loads_it(saved, name):
    folder, cls = saved[name]
    plan = pipelines.plan_model(folder, device_map="balanced", torch_dtype=torch.bfloat16, max_memory={0: "1GiB"})
    reference = cls.from_pretrained(folder, dtype=torch.bfloat16)
    # To the byte but for transformers' re-typing of a few non-persistent scalars (Gemma3's embed_scale).
    assert plan.components[cls.__name__].bytes == pytest.approx(size_module(reference).total, rel=1e-3)
    assert plan.components[cls.__name__].dtype == "bfloat16 (torch_dtype)"


@pytest.mark.parametrize("name", ["gemma3", "mistral3"])
def test_a_split_whose_embedding_is_called_from_outside_its_entry(saved, name, monkeypatch):
    """Gemma3/Mistral3 call `get_input_embeddings()(input_ids)` from the parent: the ids never pass the language
    model entry's hook, so the embedding carries its own (strict virtual devices fail a mix-up as a GPU would)."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    folder, cls = saved[name]
    _, model = _split_over_two(folder, cls, torch.float32)
    reference = cls.from_pretrained(folder, dtype=torch.float32).eval()
    assert set(model.hf_device_map.values()) == {0, 1}
    assert_same_output(output_of(model, name), output_of(reference, name))


def test_the_renamed_tensors_are_read_by_transformers_onto_the_plan(saved, monkeypatch):
    """The owner loads with our map (here: to the CPU, as virtual GPUs exist for this library only), then our
    runtime places it: one input hook at the top of a whole component, none inside."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, cls = saved["qwen2_5_vl"]
    model = pipelines.load_model(folder, device_map="auto", max_memory={0: "1GiB"}, progress=False)
    assert model.hf_device_map == {"": 0}
    assert {tensor.device.type for tensor in model.parameters()} == {"vgpu"}
    hooked = [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    assert hooked == [""]


def test_a_checkpoint_whose_keys_no_rename_explains_still_names_them(saved, tmp_path):
    folder, cls = saved["qwen2_5_vl"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.not_a_layer.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(pipelines.FolderError, match="embed_tokens"):
        pipelines.load_model(broken, device_map="auto", progress=False)


def test_model_mixin_points_a_transformers_or_diffusers_folder_to_load_model(saved):
    folder, _ = saved["t5"]
    with pytest.raises(pipelines.LoadError, match=r"transformers T5EncoderModel.*load_model"):
        pipelines.ModelMixin.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "architectures" in config
