"""`Pipeline.from_pretrained(single_file, config=local folder)`: the diffusers models a single-file checkpoint
holds (safetensors, or GGUF as the community shares FLUX transformers) are planned on meta through diffusers'
single-file path and read by its `from_single_file`, the rest from the config folder; offline, and equal to
diffusers' own `from_single_file` passed into its `from_pretrained`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import pipelines
from placement.sizing import size_module

from quantized_models import write_gguf
from test_diffusers_pipelines import CALLS, build_flux, diffusers, generate
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    torch.manual_seed(0)
    pipe = build_flux(root)
    pipe.save_pretrained(root / "flux")
    state = {name: tensor.contiguous() for name, tensor in pipe.transformer.state_dict().items()}
    save_file(state, root / "flux-transformer.safetensors")
    write_gguf(state, root / "flux-transformer-Q8_0.gguf", "Q8_0")
    return root


def _diffusers_own(root, file, **options):
    transformer = diffusers.FluxTransformer2DModel.from_single_file(
        str(root / file), config=str(root / "flux" / "transformer"), local_files_only=True, **options)
    return diffusers.FluxPipeline.from_pretrained(root / "flux", transformer=transformer, **(
        {"torch_dtype": options["torch_dtype"]} if "torch_dtype" in options else {}))


@pytest.mark.parametrize("file", ["flux-transformer.safetensors", "flux-transformer-Q8_0.gguf"])
def test_a_single_file_transformer_loads_into_its_pipeline_as_diffusers_does(flux, file):
    options = {}
    if file.endswith(".gguf"):
        options = {"torch_dtype": torch.bfloat16,
                   "quantization_config": diffusers.GGUFQuantizationConfig(compute_dtype=torch.bfloat16)}
    reference = _diffusers_own(flux, file, **options)
    torch_dtype = options.get("torch_dtype")
    plan = pipelines.Pipeline.plan_placement(flux / file, config=flux / "flux", torch_dtype=torch_dtype,
                                             max_memory={0: "1GiB"})
    assert plan.components["transformer"].bytes == size_module(reference.transformer).total
    assert f"single file {file}" in plan.components["transformer"].dtype

    pipe = pipelines.Pipeline.from_pretrained(flux / file, config=flux / "flux", device_map="balanced",
                                              torch_dtype=torch_dtype, progress=False)
    assert type(pipe) is diffusers.FluxPipeline
    assert_same_output(generate(pipe, "flux"), generate(reference, "flux"))


def test_a_single_file_needs_its_config_folder(flux):
    with pytest.raises(pipelines.LoadError, match="config="):
        pipelines.Pipeline.from_pretrained(flux / "flux-transformer.safetensors", device_map="balanced")


def test_a_file_holding_none_of_the_pipelines_models_is_named(flux, tmp_path):
    save_file({"unrelated.weight": torch.zeros(4, 4)}, tmp_path / "other.safetensors")
    with pytest.raises(pipelines.LoadError, match="holds the weights of none"):
        pipelines.Pipeline.plan_placement(tmp_path / "other.safetensors", config=flux / "flux")


@pytest.mark.parametrize("cut", ["half its keys", "another model's file", "another size"])
def test_a_single_file_that_is_not_the_model_is_named_with_its_keys_and_shapes(flux, tmp_path, cut):
    from safetensors.torch import load_file

    state = load_file(flux / "flux-transformer.safetensors")
    if cut == "half its keys":
        state = dict(sorted(state.items())[: len(state) // 2])
        says = rf"holds {len(state)} of its {2 * len(state)} weights \({len(state)} missing: '"
    elif cut == "another model's file":
        state = {f"encoder.{name}": tensor for name, tensor in state.items()}
        says = r"holds none of its \d+ weights"
    else:
        state = {name: torch.zeros(*[2 * size for size in tensor.shape]) for name, tensor in state.items()}
        says = r"tensor\(s\) have other shapes \('\S+' \[\d+(, \d+)*\] in the model, \[\d+(, \d+)*\] in the file"
    save_file(state, tmp_path / "cut.safetensors")
    for call in (pipelines.plan_model, pipelines.load_model):
        with pytest.raises(pipelines.LoadError, match=rf"cut.safetensors is not a FluxTransformer2DModel .*{says}"):
            call(tmp_path / "cut.safetensors", config=flux / "flux" / "transformer", max_memory={0: "1GiB"})
