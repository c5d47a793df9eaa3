"""Each quantized format, as a diffusers or transformers user meets it on this CPU: planned on meta through its
owner's quantizer within 3% of the loaded module's real storage, loaded by its owner with our plan, output equal
to the owner's own load; the same for pre-quantized folders, GGUF single files and modules quantized in memory.
(diffusers refuses bitsandbytes without a GPU: its nf4 is planned here and compared with bitsandbytes' own CPU
quantization; transformers' bitsandbytes loads on the CPU.)"""

from __future__ import annotations

import pytest
import torch

import pipelines
from pipelines.errors import FolderError
from pipelines.folder.sources import model_folder_class
from placement.sizing import size_module

from quantized_models import diffusers, real_storage, run, save_flux, save_t5, transformers, write_gguf
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for", "ignore::FutureWarning")
torchao = pytest.importorskip("torchao.quantization")
BF16 = torch.bfloat16


def _bnb(**options):
    pytest.importorskip("bitsandbytes")
    return transformers.BitsAndBytesConfig(**options)


def _quanto(weights):
    pytest.importorskip("optimum.quanto")
    return diffusers.QuantoConfig(weights)


# optimum-quanto 0.2.7 multiplies bf16 activations by int8 weights with torch._weight_int8pack_mm on the CPU,
# which can crash the process under torch 2.13; in float32 it takes its fallback (dequantize, then matmul).
QUANTO_DTYPE = torch.float32

# name -> (saves the dense folder, the quantization config, the words the plan's dtype label starts with)
FORMATS = {
    "bitsandbytes nf4 (transformers)": (save_t5, lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                              bnb_4bit_compute_dtype=BF16,
                                                              bnb_4bit_use_double_quant=True), "nf4 (bitsandbytes)"),
    "bitsandbytes int8 (transformers)": (save_t5, lambda: _bnb(load_in_8bit=True), "int8 (bitsandbytes)"),
    "torchao int8 weight-only": (save_flux, lambda: diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig()),
                                 "int8 (torchao)"),
    "torchao fp8 weight-only": (save_flux, lambda: diffusers.TorchAoConfig(torchao.Float8WeightOnlyConfig()),
                                "float8_e4m3fn (torchao)"),
    "torchao int8 (transformers)": (save_t5, lambda: transformers.TorchAoConfig(torchao.Int8WeightOnlyConfig()),
                                    "int8 (torchao)"),
    "quanto int8": (save_flux, lambda: _quanto("int8"), "int8 (quanto)"),
    "quanto fp8": (save_flux, lambda: _quanto("float8"), "float8_e4m3fn (quanto)"),
}


def dtype_of(name: str) -> torch.dtype:
    return QUANTO_DTYPE if name.startswith("quanto") else BF16


def owner_load(folder, config=None, dtype=BF16):
    """What diffusers' or transformers' own from_pretrained loads from `folder`."""
    cls = model_folder_class(folder)
    if issubclass(cls, transformers.PreTrainedModel):
        return cls.from_pretrained(folder, quantization_config=config, dtype=dtype).eval()
    return cls.from_pretrained(folder, quantization_config=config, torch_dtype=dtype).eval()


def planned(plan) -> int:
    return next(iter(plan.components.values())).bytes


@pytest.mark.parametrize("name", FORMATS)
def test_planned_within_3_percent_and_loaded_equal_to_the_owner(name, tmp_path):
    save, config, label = FORMATS[name]
    folder, dtype = save(tmp_path), dtype_of(name)
    plan = pipelines.plan_model(folder, quantization_config=config(), torch_dtype=dtype, max_memory={0: "1GiB"})
    reference = owner_load(folder, config(), dtype)
    assert planned(plan) == pytest.approx(real_storage(reference), rel=0.03)
    assert next(iter(plan.components.values())).dtype.startswith(label)

    model = pipelines.load_model(folder, quantization_config=config(), torch_dtype=dtype, progress=False)
    assert type(model) is type(reference)
    assert_same_output(run(model), run(reference))


@pytest.mark.parametrize("name", ["bitsandbytes nf4 (transformers)", "torchao int8 weight-only", "quanto int8"])
def test_a_pre_quantized_folder_is_planned_and_loaded_as_saved(name, tmp_path):
    save, config, label = FORMATS[name]
    reference = owner_load(save(tmp_path), config(), dtype_of(name))
    reference.save_pretrained(tmp_path / "saved")
    plan = pipelines.plan_model(tmp_path / "saved", max_memory={0: "1GiB"})
    assert planned(plan) == pytest.approx(real_storage(reference), rel=0.03)
    assert next(iter(plan.components.values())).dtype.startswith(label)
    assert "pre-quantized folder" in next(iter(plan.components.values())).dtype
    model = pipelines.load_model(tmp_path / "saved", progress=False)
    assert_same_output(run(model), run(reference))


def test_diffusers_nf4_is_planned_as_bitsandbytes_quantizes_it(tmp_path):
    """diffusers refuses bitsandbytes without a GPU ("No GPU found"); bitsandbytes 0.50 itself quantizes on the CPU:
    the plan is compared with the same layers quantized by bitsandbytes here."""
    bnb = pytest.importorskip("bitsandbytes")
    folder = save_flux(tmp_path)
    config = diffusers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=BF16)
    plan = pipelines.plan_model(folder, quantization_config=config, torch_dtype=BF16, max_memory={0: "1GiB"})
    model = diffusers.FluxTransformer2DModel.from_pretrained(folder, torch_dtype=BF16)
    for path, layer in list(model.named_modules()):
        if isinstance(layer, torch.nn.Linear) and path != "proj_out":  # diffusers keeps the output layer dense
            quantized = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                          compute_dtype=BF16, quant_type="nf4", compress_statistics=False)
            quantized.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=False)
            quantized.bias = layer.bias
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized.to("cpu"))  # bitsandbytes quantizes on .to()
    assert planned(plan) == pytest.approx(real_storage(model), rel=0.03)
    assert next(iter(plan.components.values())).dtype.startswith("nf4 (bitsandbytes), compute bfloat16")


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_K"])
def test_a_gguf_file_is_planned_at_its_blocks_and_loaded_by_from_single_file(quant_type, tmp_path):
    pytest.importorskip("gguf")
    folder = save_flux(tmp_path)
    dense = diffusers.FluxTransformer2DModel.from_pretrained(folder)
    path = write_gguf(dense.state_dict(), tmp_path / f"flux-{quant_type}.gguf", quant_type)
    reference = diffusers.FluxTransformer2DModel.from_single_file(
        str(path), config=str(folder), local_files_only=True, torch_dtype=BF16,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=BF16)).eval()
    plan = pipelines.plan_model(path, config=folder, torch_dtype=BF16, max_memory={0: "1GiB"})
    assert planned(plan) == pytest.approx(real_storage(reference), rel=0.03)
    assert next(iter(plan.components.values())).dtype.startswith(f"{quant_type} (gguf), compute bfloat16")
    model = pipelines.load_model(path, config=folder, torch_dtype=BF16, progress=False)
    assert_same_output(run(model), run(reference))


@pytest.mark.parametrize("damage, says", [
    (lambda data: data[: len(data) // 2], "cannot reshape"),  # a download cut in half
    (lambda data: data[:-100], "cannot reshape"),
    (lambda data: bytes(range(256)) * 20, "GGUF magic invalid"),  # not a GGUF file at all
    (lambda data: b"", "empty file"),
])
def test_a_cut_or_random_gguf_file_is_a_folder_error_naming_it(tmp_path, damage, says):
    """gguf's reader says these with a bare ValueError (numpy's reshape error for a cut file)."""
    pytest.importorskip("gguf")
    folder = save_flux(tmp_path)
    dense = diffusers.FluxTransformer2DModel.from_pretrained(folder)
    path = write_gguf(dense.state_dict(), tmp_path / "f.gguf", "Q8_0")
    path.write_bytes(damage(path.read_bytes()))
    for entry in (lambda: pipelines.plan_model(path, config=folder, max_memory={0: "1GiB"}),
                  lambda: pipelines.load_model(path, config=folder, progress=False)):
        with pytest.raises(FolderError, match=rf"GGUF file '{path}' is corrupt, truncated or not a GGUF file "
                                              rf"\(ValueError: .*{says}.*Re-download"):
            entry()


@pytest.mark.parametrize("name", ["torchao int8 weight-only", "quanto int8", "bitsandbytes nf4 (transformers)"])
def test_a_module_quantized_in_memory_is_placed_at_its_real_size(name, tmp_path):
    save, config, label = FORMATS[name]
    quantized = owner_load(save(tmp_path), config(), dtype_of(name))
    pipe = pipelines.Pipeline()
    pipe.register_components(model=quantized)
    plan = pipelines.place(pipe, device_map="cpu")
    assert plan.components["model"].bytes == pytest.approx(real_storage(quantized), rel=0.03)
    assert size_module(quantized).total == plan.components["model"].bytes
    assert plan.components["model"].dtype.startswith(label)
