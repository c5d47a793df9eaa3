"""Tiny transformers models of the text and vision encoders diffusers pipelines use, each with an input: Qwen2.5-VL
(Qwen-Image), Llava (HunyuanVideo I2V), Mistral3 (FLUX.2), Gemma2 (Lumina2), Gemma3, Llama (HiDream), T5 / UMT5
(SD3, FLUX.1, Wan), CLIP and SigLIP. transformers 5 saves some under their original key names and renames them on
load (`RENAMED`); the others' checkpoints match their modules."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from owner_folders import QWEN_TEXT as QWEN_TEXT_BASE  # noqa: E402
from owner_folders import QWEN_VISION  # noqa: E402

LLAMA_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=64, head_dim=8)
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                   patch_size=4, projection_dim=32)
IDS = torch.tensor([[5, 17, 42, 99, 3, 7]])
PIXELS = torch.linspace(-1, 1, 3 * 16 * 16).reshape(1, 3, 16, 16)


def _family(name, layers):
    t = transformers
    LLAMA = {**LLAMA_BASE, "num_hidden_layers": layers}
    QWEN_TEXT = {**QWEN_TEXT_BASE, "num_hidden_layers": layers}
    families = {
        "qwen2_5_vl": lambda: t.Qwen2_5_VLForConditionalGeneration(
            t.Qwen2_5_VLConfig(text_config=QWEN_TEXT, vision_config=QWEN_VISION)),
        "llava": lambda: t.LlavaForConditionalGeneration(t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(**CLIP_VISION), text_config=t.LlamaConfig(**LLAMA), image_token_index=299)),
        "mistral3": lambda: t.Mistral3ForConditionalGeneration(t.Mistral3Config(
            vision_config=t.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, image_size=16, patch_size=4, head_dim=8),
            text_config=t.MistralConfig(**LLAMA), image_token_index=299, spatial_merge_size=1)),
        "gemma2": lambda: t.Gemma2Model(t.Gemma2Config(**LLAMA)),
        "gemma3": lambda: t.Gemma3ForConditionalGeneration(t.Gemma3Config(
            text_config=t.Gemma3TextConfig(**LLAMA),
            vision_config=t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, image_size=16, patch_size=4),
            mm_tokens_per_image=4, image_token_index=299)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**LLAMA)),
        "t5": lambda: t.T5EncoderModel(t.T5Config(vocab_size=300, d_model=32, d_ff=64, d_kv=8, num_layers=layers,
                                                  num_heads=4, relative_attention_num_buckets=8)),
        "umt5": lambda: t.UMT5EncoderModel(t.UMT5Config(vocab_size=300, d_model=32, d_ff=64, d_kv=8, num_layers=layers,
                                                        num_heads=4, relative_attention_num_buckets=8)),
        "clip_text": lambda: t.CLIPTextModelWithProjection(t.CLIPTextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, vocab_size=300,
            max_position_embeddings=16, projection_dim=32)),
        "clip_vision": lambda: t.CLIPVisionModelWithProjection(t.CLIPVisionConfig(**CLIP_VISION)),
        "siglip_vision": lambda: t.SiglipVisionModel(t.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
            patch_size=4)),
        "siglip_text": lambda: t.SiglipTextModel(t.SiglipTextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
            max_position_embeddings=16)),
    }
    return families[name]


FAMILIES = ["qwen2_5_vl", "llava", "mistral3", "gemma2", "gemma3", "llama", "t5", "umt5", "clip_text", "clip_vision",
            "siglip_vision", "siglip_text"]


def build(name: str, seed: int = 0, layers: int = 2):
    """`layers` sets the text stack's depth (T5, CLIP text and the Llama-like ones); 2 keeps most tests fast."""
    torch.manual_seed(seed)
    return _family(name, layers)().eval()


def model_input(name: str) -> dict:
    if name in ("clip_vision", "siglip_vision"):
        return {"pixel_values": PIXELS}
    return {"input_ids": IDS}


def output_of(model, name: str) -> torch.Tensor:
    out = model(**model_input(name))
    for key in ("logits", "last_hidden_state", "text_embeds", "image_embeds"):
        value = getattr(out, key, None)
        if value is not None:
            return value.detach().cpu()
    raise AssertionError(f"no output tensor in {type(out).__name__}")
