"""A tiny QwenImagePipeline folder saved by diffusers (its Qwen2.5-VL text encoder written by transformers under the
original key names) loads through our planner as diffusers' class and runs equal to diffusers' own load: on the
CPU, spread over two virtual GPUs, and with its components quantized as they load."""

from __future__ import annotations

import pytest
import torch

import pipelines
from placement.sizing import size_module

from owner_folders import QWEN_CALL, diffusers, save_qwen_image
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen_image(tmp_path_factory.mktemp("qwen"))


def generate(pipe) -> torch.Tensor:
    return pipe(**QWEN_CALL, generator=torch.Generator().manual_seed(0)).images.cpu()


@pytest.fixture(scope="module")
def expected(folder):
    return generate(diffusers.QwenImagePipeline.from_pretrained(folder))


def test_qwen_image_loads_as_diffusers_class_and_runs_equal(folder, expected):
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", progress=False)
    assert type(pipe) is diffusers.QwenImagePipeline
    assert set(pipe.hf_device_map) == {"text_encoder", "transformer", "vae"}
    assert_same_output(generate(pipe), expected)
    reference = diffusers.QwenImagePipeline.from_pretrained(folder)
    for name, component in pipe.placement_plan.components.items():
        assert component.bytes == size_module(getattr(reference, name)).total, name


def test_qwen_image_over_two_virtual_gpus(folder, expected, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    plan = pipelines.Pipeline.plan_placement(folder, max_memory={0: "1GiB", 1: "1GiB"})
    sizes = {name: component.bytes for name, component in plan.components.items()}
    budget = {0: f"{sizes['vae'] + 8192}B", 1: f"{sizes['text_encoder'] + sizes['transformer'] + 8192}B", "cpu": "1GiB"}
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", max_memory=budget, progress=False)
    assert {device for device in pipe.hf_device_map.values()} == {0, 1}
    assert {t.device.type for t in pipe.text_encoder.parameters()} == {"vgpu"}
    assert_same_output(generate(pipe), expected)
    pipe.reset_device_map()
    assert {t.device.type for t in pipe.text_encoder.parameters()} == {"cpu"}


def test_qwen_image_quantized_as_it_loads_equals_diffusers(folder):
    torchao = pytest.importorskip("torchao.quantization")
    transformers = pytest.importorskip("transformers")
    quantization = diffusers.PipelineQuantizationConfig(quant_mapping={
        "transformer": diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig()),
        "text_encoder": transformers.TorchAoConfig(torchao.Int8WeightOnlyConfig())})
    reference = diffusers.QwenImagePipeline.from_pretrained(folder, quantization_config=quantization,
                                                            torch_dtype=torch.bfloat16)
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", quantization_config=quantization,
                                              torch_dtype=torch.bfloat16, progress=False)
    assert_same_output(generate(pipe), generate(reference))
    plan = pipe.placement_plan
    assert plan.components["transformer"].dtype == "int8 (torchao), compute bfloat16 (quantization_config)"
    for name in ("text_encoder", "transformer"):
        assert plan.components[name].bytes == pytest.approx(size_module(getattr(reference, name)).total, rel=0.03)


def test_an_nf4_text_encoder_is_kept_whole_and_the_others_planned_around_it(folder, monkeypatch):
    """bitsandbytes weights cannot be offloaded: where the strategy would offload the nf4 text encoder, it is
    kept whole on the GPU and another component offloaded instead; where it cannot fit whole, the plan is refused
    before anything is read."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "0")  # bitsandbytes' weights cannot nest in strict tensors
    quantization = diffusers.PipelineQuantizationConfig(quant_mapping={"text_encoder": transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)})
    options = dict(quantization_config=quantization, torch_dtype=torch.bfloat16)
    sizes = {name: c.bytes for name, c in pipelines.Pipeline.plan_placement(
        folder, max_memory={0: "1GiB"}, **options).components.items()}
    budget = {0: f"{sizes['vae'] + sizes['text_encoder'] + 4096}B", "cpu": "1GiB"}  # not all three whole
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", max_memory=budget, progress=False,
                                              **options)
    plan = pipe.placement_plan
    assert plan.components["text_encoder"].kind.value == "whole"
    assert plan.components["vae"].kind.value == "offloaded"
    assert any(note.startswith("text_encoder (nf4 (bitsandbytes)) kept whole on GPU 0") for note in plan.warnings)
    reference = diffusers.QwenImagePipeline.from_pretrained(folder, **options)
    # Compared on the encoder itself, with autograd on: under no_grad bitsandbytes 0.50 repacks 4-bit weights for
    # its CPU kernel, which fails for layers narrower than its block (64; this tiny encoder's are 32), whoever loads.
    ids = torch.tensor([[5, 17, 42, 9]])
    assert_same_output(pipe.text_encoder(input_ids=ids).logits, reference.text_encoder(input_ids=ids).logits)

    with pytest.raises(pipelines.LoadError, match="'text_encoder' \\(nf4 \\(bitsandbytes\\).*offloaded"):
        pipelines.Pipeline.plan_placement(folder, max_memory={0: f"{sizes['text_encoder'] - 100}B", "cpu": "1GiB"},
                                          **options)
