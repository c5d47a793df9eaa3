"""The block memo on diffusers and transformers models: FLUX and Wan transformers, T5, a UNet, a VAE decode, tiny
and at their real widths (published configs, depth cut so a few blocks repeat; the real depth and call with
--run-slow): the peak equal to the byte with and without the memo, the module order recorded the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights

import placement
from test_block_memo import assert_same_estimate

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

_DATA = Path(__file__).resolve().parents[2] / "pipelines" / "presets" / "data"  # the real pipelines' configs
_REAL = json.loads((_DATA / "real_pipelines.json").read_text())["pipelines"]
BF16 = torch.bfloat16


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def real_config(pipeline: str, component: str, **changes) -> dict:
    return {**_REAL[pipeline]["components"][component]["config"], **changes}


def built(cls, config: dict):
    with init_empty_weights():
        module = cls(cls.config_class(**config)) if hasattr(cls, "_keep_in_fp32_modules_strict") \
            else cls.from_config(config)
    return module.eval()


def flux_call(config: dict, tokens: int, text: int):
    return (), {"hidden_states": meta(1, tokens, config["in_channels"]),
                "encoder_hidden_states": meta(1, text, config["joint_attention_dim"]),
                "pooled_projections": meta(1, config["pooled_projection_dim"]), "timestep": meta(1),
                "img_ids": meta(tokens, 3), "txt_ids": meta(text, 3), "guidance": meta(1)}


def wan_call(config: dict, frames: int, height: int, width: int, text: int):
    return (), {"hidden_states": meta(1, config["in_channels"], frames, height, width), "timestep": meta(1),
                "encoder_hidden_states": meta(1, text, config["text_dim"])}


def unet_call(config: dict, side: int, batch: int = 2):
    text = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return (meta(batch, 4, side, side), meta(batch)), {
        "encoder_hidden_states": meta(batch, 77, config["cross_attention_dim"]),
        "added_cond_kwargs": {"text_embeds": meta(batch, text), "time_ids": meta(batch, 6)}}


TINY_FLUX = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
                 guidance_embeds=True)
TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
TINY_T5 = dict(vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=4, num_heads=4, feed_forward_proj="gated-gelu")
TINY_UNET = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
                 norm_num_groups=8, transformer_layers_per_block=2, addition_embed_type="text_time",
                 addition_time_embed_dim=8, projection_class_embeddings_input_dim=80)
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                norm_num_groups=8, layers_per_block=2)


def test_tiny_flux_transformer(monkeypatch):
    model = built(diffusers.FluxTransformer2DModel, TINY_FLUX)
    assert_same_estimate(monkeypatch, model, *flux_call(TINY_FLUX, tokens=64, text=12), dtype=BF16)


def test_tiny_wan_transformer(monkeypatch):
    model = built(diffusers.WanTransformer3DModel, TINY_WAN)
    assert_same_estimate(monkeypatch, model, *wan_call(TINY_WAN, 3, 8, 8, text=12), dtype=BF16)


def test_tiny_t5_encoder(monkeypatch):
    model = built(transformers.T5EncoderModel, TINY_T5)
    ids = torch.zeros(2, 20, dtype=torch.long, device="meta")
    assert_same_estimate(monkeypatch, model, (ids,), dtype=torch.float16)  # fp16: T5's `wo` kept in fp32


def test_tiny_unet(monkeypatch):
    model = built(diffusers.UNet2DConditionModel, TINY_UNET)
    config = {**TINY_UNET, "cross_attention_dim": 32}
    assert_same_estimate(monkeypatch, model, *unet_call(config, side=16), dtype=BF16)


def test_tiny_vae_decode(monkeypatch):
    model = built(diffusers.AutoencoderKL, TINY_VAE)
    assert_same_estimate(monkeypatch, model, (meta(1, 4, 16, 16),), method="decode", dtype=BF16)


def test_real_width_flux_transformer(monkeypatch):
    config = real_config("flux1-dev", "transformer", num_layers=2, num_single_layers=3)
    model = built(diffusers.FluxTransformer2DModel, config)
    assert_same_estimate(monkeypatch, model, *flux_call(config, tokens=256, text=32), dtype=BF16)


def test_real_width_wan_transformer(monkeypatch):
    config = real_config("wan2.1-t2v-14b", "transformer", num_layers=3)
    model = built(diffusers.WanTransformer3DModel, config)
    assert_same_estimate(monkeypatch, model, *wan_call(config, 2, 8, 8, text=32), dtype=BF16)


def test_real_width_t5_xxl(monkeypatch):
    model = built(transformers.T5EncoderModel, real_config("flux1-dev", "text_encoder_2", num_layers=3))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    assert_same_estimate(monkeypatch, model, (ids,), dtype=BF16)


def test_real_width_sdxl_unet(monkeypatch):
    config = real_config("sdxl-base-1.0", "unet", transformer_layers_per_block=[1, 2, 2])
    model = built(diffusers.UNet2DConditionModel, config)
    assert_same_estimate(monkeypatch, model, *unet_call(config, side=16), dtype=BF16)


def test_real_width_flux_vae_decode(monkeypatch):
    model = built(diffusers.AutoencoderKL, real_config("flux1-dev", "vae"))
    assert_same_estimate(monkeypatch, model, (meta(1, 16, 16, 16),), method="decode", dtype=BF16)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["flux", "wan", "t5", "unet", "vae"])
def test_real_configs_at_the_real_call(monkeypatch, which):
    """The benchmark's calls: FLUX.1-dev at 1024x1024, Wan 2.1 14B (Wan 2.2 A14B's experts) at 480x832x81 with
    guidance's batch of 2, T5-XXL at 512 tokens, the SDXL UNet at 1024x1024, FLUX's VAE decoding 1024x1024."""
    if which == "flux":
        config = real_config("flux1-dev", "transformer")
        model, call = built(diffusers.FluxTransformer2DModel, config), flux_call(config, tokens=4096, text=512)
    elif which == "wan":
        config = real_config("wan2.1-t2v-14b", "transformer")
        args, kwargs = wan_call(config, 21, 60, 104, text=512)
        kwargs = {key: torch.cat([value, value]) for key, value in kwargs.items()}
        model, call = built(diffusers.WanTransformer3DModel, config), (args, kwargs)
    elif which == "t5":
        model = built(transformers.T5EncoderModel, real_config("flux1-dev", "text_encoder_2"))
        call = ((torch.zeros(1, 512, dtype=torch.long, device="meta"),), None)
    elif which == "unet":
        config = real_config("sdxl-base-1.0", "unet")
        model, call = built(diffusers.UNet2DConditionModel, config), unet_call(config, side=128)
    else:
        model, call = built(diffusers.AutoencoderKL, real_config("flux1-dev", "vae")), ((meta(1, 16, 128, 128),), None)
    method = "decode" if which == "vae" else "forward"
    assert_same_estimate(monkeypatch, model, *call, method=method, dtype=BF16)


def _llm(kind: str, layers: int = 4):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)
    if kind == "llama":
        return built(transformers.LlamaModel, common)
    if kind == "gemma2":  # sliding and full attention layers alternate, each kind its own layer of the cache
        return built(transformers.Gemma2Model, {**common, "head_dim": 16, "sliding_window": 8})
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(common, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    with init_empty_weights():
        return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("kind, replayed", [("llama", 3), ("gemma2", 2), ("qwen2.5-vl", 3)])
def test_decoder_layers_filling_a_kv_cache_are_replayed(monkeypatch, kind, replayed):
    """Issue 38: an LLM encoder called as pipelines call it (ids, mask, every hidden state; transformers makes a
    DynamicCache that each layer fills) replays its identical layers, each writing its own layer of the cache:
    the peak, the calls and the FLOPs are those of the full run, and so is the cache it returns."""
    model = _llm(kind)
    ids = torch.zeros(2, 24, dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids, "attention_mask": torch.ones(2, 24, dtype=torch.long, device="meta"),
              "output_hidden_states": True}
    assert_same_estimate(monkeypatch, model, (), kwargs, replayed=replayed, dtype=BF16)
    results = {}
    for memo in ("1", "0"):
        monkeypatch.setenv("PLACEMENT_BLOCK_MEMO", memo)
        estimate = placement.estimate_call(model, (), kwargs, dtype=BF16)
        cache = estimate.output.past_key_values
        results[memo] = (estimate.peak_bytes, estimate.flops, estimate.bytes_touched,
                         [(type(layer).__name__, tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype)
                          for layer in cache.layers])
    assert results["1"] == results["0"]
    assert len(results["1"][3]) == 4 and results["1"][1] > 0
