"""Quantized components offloaded by our runtime: their tensors move as they are (never dequantized on the host)
and the output equals the owner's load; what a format cannot do is refused when the plan is made.

Run on one strict virtual accelerator: torchao's tensors move as a real `.to()` moves them (their inner tensors
become virtual, their own F.linear runs) and mix-ups raise as on CUDA. quanto's and diffusers' GGUF tensors run on
one that is the plain CPU (`PLACEMENT_VIRTUAL_STRICT=0`, `NOT_STRICT`): quanto serializes an inner tensor whose
type is not exactly torch.Tensor as a nested subclass, and GGUFParameter re-wraps the raw tensor, which the strict
mode's own tensor subclass already owns; the point here is what the offload runtime does to them (which tensors
move, in which form), not device bookkeeping."""

from __future__ import annotations

import pytest
import torch

import hooks
import pipelines
from placement.sizing import is_quantized_tensor

from quantized_models import diffusers, real_storage, run, save_flux, save_t5, transformers, write_gguf
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for", "ignore::FutureWarning")
torchao = pytest.importorskip("torchao.quantization")
BF16 = torch.bfloat16


NOT_STRICT = ("quanto", "gguf")  # formats whose tensor subclasses cannot hold a strict virtual tensor (see above)


@pytest.fixture
def one_cpu_backed_gpu(request, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    name = getattr(request.node, "callspec", None) and request.node.callspec.params.get("name", "")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "0" if name and name.startswith(NOT_STRICT) else "1")


def quantized_classes(module) -> set[str]:
    return {type(t).__name__ for t in module.parameters() if is_quantized_tensor(t)}


def place_offloaded(module, **options):
    """`module` in a generic pipeline placed with a GPU budget of 60% of it: offloaded (part resident, the rest
    moved per call)."""
    pipe = pipelines.Pipeline()
    pipe.register_components(model=module)
    plan = pipelines.place(pipe, max_memory={0: f"{real_storage(module) * 6 // 10}B", "cpu": "1GiB"}, **options)
    assert plan.components["model"].kind.value == "offloaded"
    return pipe


def moved_by_a_second_call(module) -> int:
    """Host -> accelerator weight bytes of a call in steady state (the first call may find blocks loaded)."""
    run(module)
    with hooks.measure_transfers() as meter:
        run(module)
    return meter.weights.host_to_accelerator_bytes


def host_homed_storage(pipe) -> int:
    """The real storage of what the plan keeps off the accelerator: the part a call has to bring over."""
    transfer = pipe.placement_plan.components["model"].transfer
    return real_storage(pipe.model) - transfer.resident_bytes


STREAMED_BLOCKS = {"": 0, "single_transformer_blocks": "cpu", "transformer_blocks": "cpu"}  # model-level streaming


def _torchao(folder):
    config = diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig())
    return dict(quantization_config=config, torch_dtype=BF16), diffusers.FluxTransformer2DModel.from_pretrained(
        folder, quantization_config=config, torch_dtype=BF16).eval()


def _torchao_fp8(folder):
    config = diffusers.TorchAoConfig(torchao.Float8WeightOnlyConfig())
    return dict(quantization_config=config, torch_dtype=BF16), diffusers.FluxTransformer2DModel.from_pretrained(
        folder, quantization_config=config, torch_dtype=BF16).eval()


def _quanto(folder):
    pytest.importorskip("optimum.quanto")
    config = diffusers.QuantoConfig("int8")
    dtype = torch.float32  # quanto's CPU int8 kernel for bf16 can crash under torch 2.13 (see test_quantized_formats)
    return dict(quantization_config=config, torch_dtype=dtype), diffusers.FluxTransformer2DModel.from_pretrained(
        folder, quantization_config=config, torch_dtype=dtype).eval()


def _gguf(folder):
    pytest.importorskip("gguf")
    path = write_gguf(diffusers.FluxTransformer2DModel.from_pretrained(folder).state_dict(),
                      folder.parent / "f.gguf", "Q8_0")
    reference = diffusers.FluxTransformer2DModel.from_single_file(
        str(path), config=str(folder), local_files_only=True, torch_dtype=BF16,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=BF16)).eval()
    return dict(config=folder, torch_dtype=BF16, pretrained=path), reference


FORMATS = {"torchao int8": (_torchao, "Int8Tensor"), "torchao fp8": (_torchao_fp8, "Float8Tensor"),
           "quanto int8": (_quanto, "WeightQBytesTensor"),
           "gguf Q8_0": (_gguf, "GGUFParameter")}


@pytest.mark.parametrize("name", FORMATS)
def test_group_offloaded_moves_quantized_tensors_as_they_are(name, one_cpu_backed_gpu, tmp_path):
    make, kind = FORMATS[name]
    folder = save_flux(tmp_path, layers=4)
    options, reference = make(folder)
    expected = run(reference)
    pipe = place_offloaded(reference)
    assert_same_output(run(pipe.model), expected)
    assert quantized_classes(pipe.model) == {kind}  # never dequantized on the host
    # A call moves what the plan says, each tensor at its quantized storage (not as dense bf16/fp32).
    moved = moved_by_a_second_call(pipe.model)
    assert 0 < moved == pipe.placement_plan.transfer_bytes_per_call
    assert moved == host_homed_storage(pipe)
    pipe.reset_device_map()
    assert quantized_classes(pipe.model) == {kind}


def test_fp8_layerwise_cast_weights_are_offloaded_in_fp8(one_cpu_backed_gpu, tmp_path):
    folder = save_flux(tmp_path, layers=4)
    model = diffusers.FluxTransformer2DModel.from_pretrained(folder, torch_dtype=BF16).eval()
    reference = diffusers.FluxTransformer2DModel.from_pretrained(folder, torch_dtype=BF16).eval()
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=BF16)
    pipe = place_offloaded(model, layerwise_casting={"model": torch.float8_e4m3fn})
    assert pipe.placement_plan.components["model"].bytes == real_storage(reference)
    assert_same_output(run(pipe.model), run(reference))
    moved = moved_by_a_second_call(pipe.model)  # fp8 bytes moved, not bf16
    assert 0 < moved == pipe.placement_plan.transfer_bytes_per_call == host_homed_storage(pipe)


def test_streamed_blocks_of_a_loaded_torchao_model_equal_diffusers(one_cpu_backed_gpu, tmp_path):
    folder = save_flux(tmp_path)
    options, reference = _torchao(folder)
    pretrained = options.pop("pretrained", folder)
    model = pipelines.load_model(pretrained, device_map=STREAMED_BLOCKS, progress=False, **options)
    assert next(iter(model.placement_plan.components.values())).kind.value == "offloaded"
    assert_same_output(run(model), run(reference))
    assert quantized_classes(model) == {"Int8Tensor"}


@pytest.mark.parametrize("name", ["quanto int8", "gguf Q8_0"])
def test_quanto_or_gguf_blocks_kept_on_the_host_run_by_the_transfer_plan(name, one_cpu_backed_gpu, tmp_path):
    """A model-level map with host entries runs under per-call residency, which moves module groups with their
    tensors as they are (accelerate's weight hooks, which would rebuild them as plain tensors, are not used)."""
    make, kind = FORMATS[name]
    options, reference = make(save_flux(tmp_path))
    pretrained = options.pop("pretrained", tmp_path / "flux")
    model = pipelines.load_model(pretrained, device_map=STREAMED_BLOCKS, progress=False, **options)
    plan = model.placement_plan
    assert next(iter(plan.components.values())).kind.value == "offloaded"
    assert_same_output(run(model), run(reference))
    assert quantized_classes(model) == {kind}
    assert 0 < moved_by_a_second_call(model) == plan.transfer_bytes_per_call


def test_bitsandbytes_offloaded_is_refused_when_planned(one_cpu_backed_gpu, tmp_path):
    pytest.importorskip("bitsandbytes")
    folder = save_t5(tmp_path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=BF16)
    streamed = {"shared": 0, "encoder.block.0": 0, "encoder.block.1": "cpu", "encoder.final_layer_norm": 0}
    refused = r"'T5EncoderModel' \(fp4 \(bitsandbytes\).*offloaded.*cannot be offloaded apart"
    with pytest.raises(pipelines.LoadError, match=refused):
        pipelines.plan_model(folder, quantization_config=config, torch_dtype=BF16, device_map=streamed,
                             max_memory={0: "1GiB", "cpu": "1GiB"})
    quantized = transformers.T5EncoderModel.from_pretrained(folder, quantization_config=config, dtype=BF16)
    pipe = pipelines.Pipeline()
    pipe.register_components(model=quantized)
    with pytest.raises(pipelines.LoadError, match=r"'model' \(fp4 \(bitsandbytes\)"):
        pipelines.place(pipe, device_map={"model": streamed}, max_memory={0: "1GiB", "cpu": "1GiB"})
    assert pipe.hf_device_map is None  # refused before anything moved
    whole = pipelines.plan_model(folder, quantization_config=config, torch_dtype=BF16, max_memory={0: "1GiB"})
    assert next(iter(whole.components.values())).kind.value == "whole"


def test_a_quantized_component_on_disk_is_refused_when_planned(one_cpu_backed_gpu, tmp_path):
    folder = save_flux(tmp_path)
    config = diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig())
    with pytest.raises(pipelines.LoadError, match="disk.*safetensors files, which hold plain tensors only"):
        pipelines.plan_model(folder, quantization_config=config, torch_dtype=BF16, offload_folder=tmp_path / "off",
                             max_memory={0: "8KiB", "cpu": "8KiB"})


def test_fp8_layerwise_casting_on_disk_is_refused_when_planned(one_cpu_backed_gpu, tmp_path):
    """The disk copy would be written before the fp8 cast: served from it, the layers would compute at full
    precision, so a plan putting a cast component on disk is refused before anything is read."""
    folder = save_flux(tmp_path, layers=4)
    with pytest.raises(pipelines.LoadError, match=r"layerwise float8_e4m3fn.*on disk.*max_memory\['cpu'\]"):
        pipelines.plan_model(folder, torch_dtype=BF16, layerwise_casting=torch.float8_e4m3fn,
                             offload_folder=tmp_path / "off", max_memory={0: "8KiB", "cpu": "8KiB"})


@pytest.mark.parametrize("name", ["torchao int8", "torchao fp8"])
def test_torchao_weights_split_over_two_strict_gpus_run_there(name, monkeypatch, tmp_path):
    """Two devices, strict: the quantized tensors follow their blocks (F.linear is torchao's own kernel on each
    device), and the hidden state crosses where the split does."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")
    make, kind = FORMATS[name]
    options, reference = make(save_flux(tmp_path, layers=2))
    expected = run(reference)
    pipe = pipelines.Pipeline()
    pipe.register_components(model=reference)
    pipelines.place(pipe, device_map={"model": {"": 0, "single_transformer_blocks": 1}},
                    max_memory={0: "1GiB", 1: "1GiB", "cpu": "1GiB"})
    blocks = pipe.model.single_transformer_blocks
    assert {type(blocks[0].proj_out.weight).__name__} == {kind} and blocks[0].proj_out.weight.device.index == 1
    assert_same_output(run(pipe.model), expected)
