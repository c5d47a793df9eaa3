"""Real diffusers pipelines end to end: folders written by diffusers itself (tiny random weights, tokenizers built
from a vocabulary written here, no network) load through `pipelines.Pipeline.from_pretrained` as the diffusers
class they name, placed by our planner, and generate exactly what diffusers' own plain load generates."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pipelines
from hooks.errors import OffloadConflictError
from pipelines import Pipeline
from pipelines.errors import LoadError

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

from same_output import assert_same_output
from tiny_parts import clip_config, clip_tokenizer, flow_vae, t5_encoder, t5_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for", "ignore::FutureWarning")

TWO_GPUS = {0: "1GiB", 1: "1GiB", "cpu": "4GiB"}


def has_hooks(pipe) -> list[str]:
    """Paths of every submodule of a diffusers pipeline's modules still carrying an accelerate hook."""
    modules = [(name, obj) for name, obj in pipe.components.items() if isinstance(obj, torch.nn.Module)]
    return [f"{name}.{path}" for name, module in modules for path, sub in module.named_modules()
            if hasattr(sub, "_hf_hook")]


# ------------------------------------------------------------------------------------------ tiny pipelines
def build_sd(root):
    return diffusers.StableDiffusionPipeline(
        vae=flow_vae(4), text_encoder=transformers.CLIPTextModel(clip_config()), tokenizer=clip_tokenizer(root / "vocab"),
        unet=diffusers.UNet2DConditionModel(
            block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32, norm_num_groups=1, attention_head_dim=4),
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)


def build_sdxl(root):
    tokenizer = clip_tokenizer(root / "vocab")
    return diffusers.StableDiffusionXLPipeline(
        unet=diffusers.UNet2DConditionModel(
            block_out_channels=(2, 4), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
            addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
            cross_attention_dim=64, norm_num_groups=1),
        vae=flow_vae(4), text_encoder=transformers.CLIPTextModel(clip_config()), tokenizer=tokenizer,
        text_encoder_2=transformers.CLIPTextModelWithProjection(clip_config()), tokenizer_2=tokenizer,
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1))


def build_flux(root):
    return diffusers.FluxPipeline(
        transformer=diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
        text_encoder=transformers.CLIPTextModel(clip_config()), tokenizer=clip_tokenizer(root / "vocab"),
        text_encoder_2=t5_encoder(), tokenizer_2=t5_tokenizer(), vae=flow_vae(1),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def build_sd3(root):
    tokenizer = clip_tokenizer(root / "vocab")
    return diffusers.StableDiffusion3Pipeline(
        transformer=diffusers.SD3Transformer2DModel(
            sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4),
        text_encoder=transformers.CLIPTextModelWithProjection(clip_config()), tokenizer=tokenizer,
        text_encoder_2=transformers.CLIPTextModelWithProjection(clip_config()), tokenizer_2=tokenizer,
        text_encoder_3=t5_encoder(), tokenizer_3=t5_tokenizer(), vae=flow_vae(4),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def build_wan(root):
    return diffusers.WanPipeline(
        transformer=diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        vae=diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                       temperal_downsample=[False, True, True]),
        text_encoder=t5_encoder(transformers.UMT5EncoderModel), tokenizer=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


CALLS = {  # (builder, call arguments)
    "sd": (build_sd, {"height": 8, "width": 8}),
    "sdxl": (build_sdxl, {"height": 16, "width": 16}),
    "flux": (build_flux, {"height": 8, "width": 8, "max_sequence_length": 8}),
    "sd3": (build_sd3, {"height": 8, "width": 8, "max_sequence_length": 8}),
    "wan": (build_wan, {"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 8}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusers")
    made = {}
    for name, (build, _) in CALLS.items():
        torch.manual_seed(0)
        build(root / f"{name}-parts").save_pretrained(root / name)
        made[name] = root / name
    return made


def generate(pipe, family):
    _, call = CALLS[family]
    with torch.no_grad():
        output = pipe(prompt="a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0),
                      output_type="pt", **call)
    return output.frames if family == "wan" else output.images


# ------------------------------------------------------------------------------------------------ the class
@pytest.mark.parametrize("family, device_map", [
    *[(family, "balanced") for family in CALLS],
    ("wan", "cpu"),
])
def test_loads_as_the_diffusers_class_and_generates_what_diffusers_does(folders, family, device_map, monkeypatch):
    # "balanced" over two virtual (CPU-backed) GPUs: integer devices, one input-moving hook per component, and
    # the Wan VAE's in-place causal cache survives them (accelerate's per-submodule hooks lost frames).
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    folder = folders[family]
    pipe = Pipeline.from_pretrained(folder, device_map=device_map, max_memory={0: "1GiB", 1: "1GiB", "cpu": "4GiB"},
                                    progress=False)
    pipeline_class = getattr(diffusers, json.loads((folder / "model_index.json").read_text())["_class_name"])
    assert type(pipe) is pipeline_class
    modules = {name for name, obj in pipe.components.items() if isinstance(obj, torch.nn.Module)}
    assert set(pipe.placement_plan.components) == modules
    # As diffusers sets it: {component: device} for a strategy, the device itself for one device.
    assert pipe.hf_device_map == ("cpu" if device_map == "cpu" else pipe.placement_plan.device_map)
    ours = generate(pipe, family)
    theirs = generate(pipeline_class.from_pretrained(folder), family)
    assert_same_output(ours.cpu(), theirs)  # output_type="pt": on the device the VAE decoded on
    if device_map == "cpu":
        pipe.to("cpu")  # diffusers' guard lets a one-device map move, as it does for its own device_map="cpu"
    if family == "wan":
        assert ours.shape[1] == CALLS["wan"][1]["num_frames"]  # every frame decoded (Wan VAE's causal cache)


def test_diffusers_guards_hold_until_our_reset_then_to_and_offload_work(folders):
    pipe = Pipeline.from_pretrained(folders["sd"], device_map="balanced", progress=False)
    with pytest.raises(ValueError, match="reset_device_map"):
        pipe.to("cpu")
    with pytest.raises(ValueError, match="reset_device_map"):
        pipe.enable_model_cpu_offload()
    pipe.reset_device_map()
    assert pipe.hf_device_map is None and pipe.placement_plan is None and not has_hooks(pipe)
    pipe.to("cpu")  # diffusers' own .to() is allowed again, and so are its offload methods
    expected = generate(diffusers.StableDiffusionPipeline.from_pretrained(folders["sd"]), "sd")
    pipe.enable_model_cpu_offload(device="cpu")  # without device= it asks for an accelerator
    assert_same_output(generate(pipe, "sd"), expected)
    pipe.remove_all_hooks()
    pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    assert_same_output(generate(pipe, "sd"), expected)


def test_plan_placement_accepts_diffusers_folders_and_states_dtypes(folders):
    plan = Pipeline.plan_placement(folders["flux"], max_memory=TWO_GPUS, torch_dtype=torch.bfloat16)
    assert plan.execution_order == ["text_encoder", "text_encoder_2", "transformer", "vae"]  # model_cpu_offload_seq
    assert plan.components["transformer"].dtype == "bfloat16 (torch_dtype)"
    assert "bfloat16 (torch_dtype)" in plan.explain()
    assert Pipeline.plan_placement(folders["flux"], max_memory=TWO_GPUS).components["vae"].dtype == \
        "float32 (checkpoint)"


def test_configs_only_planning_says_which_dtype_it_assumed(folders, tmp_path):
    configs_only = tmp_path / "flux"
    shutil.copytree(folders["flux"], configs_only, ignore=shutil.ignore_patterns("*.safetensors"))
    plan = Pipeline.plan_placement(configs_only, max_memory=TWO_GPUS)
    assert plan.components["transformer"].dtype.startswith("float32 (config.json only")
    assert "give torch_dtype" in plan.explain()


def test_diffusers_models_keep_their_fp32_modules_in_sizing_and_loading(folders):
    pipe = Pipeline.from_pretrained(folders["wan"], device_map="balanced", torch_dtype=torch.bfloat16,
                                    progress=False)
    transformer = pipe.transformer
    assert transformer.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert transformer.proj_out.weight.dtype == torch.bfloat16
    planned = pipe.placement_plan.components["transformer"]
    tensors = [*transformer.parameters(), *transformer.buffers()]
    assert planned.bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert "float32 kept" in planned.dtype


@pytest.mark.parametrize("dtype, wo_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_transformers_t5_keeps_wo_in_fp32_only_at_fp16_in_plan_and_load(tmp_path, dtype, wo_dtype):
    t5_encoder().save_pretrained(tmp_path / "pipe" / "text_encoder")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(
        {"_class_name": "MyT5Pipeline", "text_encoder": ["transformers", "T5EncoderModel"]}))
    plan = Pipeline.plan_placement(tmp_path / "pipe", torch_dtype=dtype, generic=True)
    pipe = Pipeline.from_pretrained(tmp_path / "pipe", device_map="balanced", torch_dtype=dtype, generic=True,
                                    progress=False)
    encoder = pipe.text_encoder
    assert encoder.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == wo_dtype
    assert encoder.encoder.block[0].layer[1].DenseReluDense.wi.weight.dtype == dtype
    loaded = sum(p.numel() * p.element_size() for p in encoder.parameters())
    assert plan.components["text_encoder"].bytes == pipe.placement_plan.components["text_encoder"].bytes == loaded
    kept = "; float32 kept: wo" if wo_dtype == torch.float32 else ""
    assert plan.components["text_encoder"].dtype == f"{str(dtype).removeprefix('torch.')} (torch_dtype{kept})"


# --------------------------------------------------------------------------------------- errors and generic
def test_a_missing_component_is_named_with_the_class_and_generic_loads_on_request(folders, tmp_path):
    partial = tmp_path / "flux"
    shutil.copytree(folders["flux"], partial)
    shutil.rmtree(partial / "vae")
    index = json.loads((partial / "model_index.json").read_text())
    del index["vae"]
    (partial / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match=r"FluxPipeline needs component\(s\) \['vae'\].*generic=True"):
        Pipeline.from_pretrained(partial, device_map="balanced", progress=False)
    pipe = Pipeline.from_pretrained(partial, device_map="balanced", progress=False, generic=True)
    assert type(pipe) is Pipeline and set(pipe.hf_device_map) == {"text_encoder", "text_encoder_2", "transformer"}


def test_a_class_the_installed_diffusers_lacks_is_named(folders, tmp_path):
    other = tmp_path / "sd"
    shutil.copytree(folders["sd"], other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "FuturePipeline"}))
    with pytest.raises(LoadError, match="'FuturePipeline'.*generic=True"):
        Pipeline.plan_placement(other, max_memory=TWO_GPUS)
    assert type(Pipeline.from_pretrained(other, generic=True, progress=False)) is Pipeline


# ------------------------------------------------------------------------------------------- round trips
def test_a_plan_round_trips_as_plan_json_file_and_flat_map(folders, tmp_path):
    folder = folders["sd"]
    budget = int(sum(c.bytes for c in Pipeline.plan_placement(folder, max_memory=TWO_GPUS).components.values()) * 0.6)
    plan = Pipeline.plan_placement(folder, max_memory={0: f"{budget}B", 1: f"{budget}B"})
    assert {d for c in plan.components.values() for d in c.devices} == {0, 1}
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert Pipeline.plan_placement(folder, device_map=plan) == plan
    assert Pipeline.plan_placement(folder, device_map=str(tmp_path / "plan.json")) == plan
    flat = Pipeline.plan_placement(folder, device_map=plan.device_map, max_memory={0: f"{budget}B", 1: f"{budget}B"})
    assert flat.device_map == plan.device_map
    with pytest.raises(LoadError, match="sized 'text_encoder' at .* torch_dtype=torch.float16"):
        Pipeline.plan_placement(folder, device_map=plan, torch_dtype=torch.float16)


def test_a_saved_cpu_plan_loads_to_the_same_map(folders, tmp_path):
    plan = Pipeline.plan_placement(folders["sd"], device_map="cpu")
    (tmp_path / "plan.json").write_text(plan.to_json())
    pipe = Pipeline.from_pretrained(folders["sd"], device_map=tmp_path / "plan.json", progress=False)
    assert pipe.hf_device_map == plan.device_map and pipe.placement_plan == plan


# ------------------------------------------------------------------------------------ place() a built one
def test_place_a_pipeline_the_user_built_without_reloading(folders):
    built = diffusers.FluxPipeline.from_pretrained(folders["flux"])
    transformer = built.transformer
    plan = pipelines.place(built, device_map="balanced", max_memory={"cpu": "4GiB"})
    assert built.transformer is transformer  # placed, not reloaded
    assert built.hf_device_map == plan.device_map and built.placement_plan is plan
    assert plan.components["transformer"].dtype == "float32 (as it is, placed by pipelines.place)"
    with pytest.raises(OffloadConflictError, match="reset_device_map"):
        pipelines.place(built)
    reference = diffusers.FluxPipeline.from_pretrained(folders["flux"])
    assert_same_output(generate(built, "flux"), generate(reference, "flux"))
    built.reset_device_map()
    assert built.hf_device_map is None and not has_hooks(built)


def test_a_component_passed_in_is_placed_with_the_rest_not_reloaded(folders):
    vae = diffusers.AutoencoderKL.from_pretrained(folders["flux"] / "vae")
    pipe = Pipeline.from_pretrained(folders["flux"], device_map="balanced", vae=vae, progress=False)
    assert type(pipe) is diffusers.FluxPipeline and pipe.vae is vae
    assert pipe.placement_plan.components["vae"].dtype == "float32 (passed in, as it is)"
    reference = diffusers.FluxPipeline.from_pretrained(folders["flux"])
    assert_same_output(generate(pipe, "flux"), generate(reference, "flux"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_on_the_gpu_the_placed_class_generates_what_diffusers_does_on_it(folders, family):
    pipe = Pipeline.from_pretrained(folders[family], device_map="balanced", torch_dtype=torch.float32,
                                    progress=False)
    assert {c.execution_device for c in pipe.placement_plan.components.values()} == {0}
    reference = getattr(diffusers, type(pipe).__name__).from_pretrained(folders[family]).to("cuda")
    torch.testing.assert_close(generate(pipe, family).cpu(), generate(reference, family).cpu(), atol=1e-5, rtol=0)
