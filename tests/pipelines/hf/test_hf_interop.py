"""A diffusers-format folder written by diffusers and transformers themselves (tiny random configs): planned for
two fictitious GPUs and loaded on the CPU as a generic Pipeline (generic=True; without it the diffusers class is
built, see test_diffusers_pipelines.py), with outputs equal to the originals."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from pipeline_fixtures import has_hooks
from pipelines import Pipeline
from same_output import assert_same_output

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def tiny_tokenizer(folder):
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for index, letter in enumerate("abcdefghijklmnopqrstuvwxyz"):
        vocab[letter], vocab[letter + "</w>"] = 3 + index, 29 + index
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")), len(vocab)


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    """A StableDiffusionPipeline saved by diffusers: transformers text encoder + tokenizer, diffusers UNet/VAE."""
    root = tmp_path_factory.mktemp("hf")
    tokenizer, vocab_size = tiny_tokenizer(root / "vocab")
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=vocab_size,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=32, attention_head_dim=8).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32,), in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=32, sample_size=16).eval()
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(root / "sd")
    return root / "sd", {"text_encoder": text_encoder, "unet": unet, "vae": vae, "tokenizer": tokenizer}


def test_the_folder_uses_each_librarys_own_weight_names(sd_folder):
    folder, _ = sd_folder
    assert (folder / "text_encoder" / "model.safetensors").is_file()
    assert (folder / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def test_plan_for_two_fictitious_gpus_spans_both(sd_folder):
    folder, _ = sd_folder
    sizes = {n: c.bytes for n, c in Pipeline.plan_placement(folder, max_memory={0: "1GiB"}).components.items()}
    assert set(sizes) == {"text_encoder", "unet", "vae"}  # tokenizer/scheduler are not placed
    budget = int(sum(sizes.values()) * 0.6)
    plan = Pipeline.plan_placement(folder, max_memory={0: budget, 1: budget})
    assert plan.execution_order == ["text_encoder", "unet", "vae"]  # StableDiffusionPipeline's known order
    assert {d for c in plan.components.values() for d in c.devices} == {0, 1}
    assert set(key.split(".")[0] for key in plan.device_map) == set(sizes)


def test_generic_load_on_cpu_gives_the_originals_outputs(sd_folder):
    folder, originals = sd_folder
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", progress=False, generic=True)
    assert type(pipe) is Pipeline
    assert set(pipe.hf_device_map) == {"text_encoder", "unet", "vae"}
    assert isinstance(pipe.tokenizer, transformers.CLIPTokenizer)
    assert isinstance(pipe.scheduler, diffusers.EulerDiscreteScheduler)
    ids = torch.tensor(originals["tokenizer"](["a cat"], padding="max_length", max_length=16).input_ids)
    latents, context = torch.randn(1, 4, 8, 8), torch.randn(1, 16, 32)
    with torch.no_grad():
        assert_same_output(pipe.text_encoder(ids).last_hidden_state, originals["text_encoder"](ids).last_hidden_state)
        assert_same_output(pipe.unet(latents, 10, context).sample, originals["unet"](latents, 10, context).sample)
        assert_same_output(pipe.vae.decode(latents).sample, originals["vae"].decode(latents).sample)
    pipe.reset_device_map()
    assert not has_hooks(pipe)


def test_a_library_tokenizer_that_cannot_load_is_reported_and_skipped(sd_folder, tmp_path):
    folder, _ = sd_folder
    copy = tmp_path / "sd"
    shutil.copytree(folder, copy)
    for path in (copy / "tokenizer").iterdir():
        path.write_text("not a tokenizer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = Pipeline.plan_placement(copy, max_memory={0: "1GiB", 1: "1GiB"})
    assert any("'tokenizer'" in str(w.message) and "skipped" in str(w.message) for w in caught)
    assert set(plan.components) == {"text_encoder", "unet", "vae"}


def test_tied_transformers_weights_load_from_the_one_saved_copy(tmp_path):
    """T5 saves `shared.weight` only; `encoder.embed_tokens.weight` is tied to it and must be re-tied."""
    torch.manual_seed(0)
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)).eval()
    t5.save_pretrained(tmp_path / "pipe" / "text_encoder_2")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "text_encoder_2": ["transformers", "T5EncoderModel"]}))
    pipe = Pipeline.from_pretrained(tmp_path / "pipe", device_map="balanced", progress=False, generic=True)
    loaded = pipe.text_encoder_2
    assert loaded.shared.weight is loaded.encoder.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert_same_output(loaded(ids).last_hidden_state, t5(ids).last_hidden_state)
