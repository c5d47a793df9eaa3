"""Tiny folders saved by diffusers and transformers themselves for the owner-loader tests: a QwenImagePipeline
(its Qwen2.5-VL text encoder is saved under transformers' original key names), and tiny transformers models of
the families whose checkpoints transformers renames on load (or not), each with an input to run it on."""

from __future__ import annotations

from pathlib import Path

import torch

transformers = __import__("pytest").importorskip("transformers")
diffusers = __import__("pytest").importorskip("diffusers")

QWEN_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
                 rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=0, eos_token_id=1)
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                   spatial_merge_size=1, temporal_patch_size=1, in_channels=3, window_size=4, fullatt_block_indexes=[0])


def byte_level_tokenizer(cls=None):
    """A byte-level BPE tokenizer of the Qwen2 kind with no merges: every byte a token (vocab 256 + specials)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    cls = cls or transformers.Qwen2Tokenizer
    return cls(vocab=vocab, merges=[], unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def qwen_text_encoder(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen2_5_VLConfig(text_config=QWEN_TEXT, vision_config=QWEN_VISION)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_pipeline(seed: int = 0):
    """A QwenImagePipeline of tiny random models, built by diffusers and transformers."""
    torch.manual_seed(seed)
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(2, 2, 4)).eval()
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                           temperal_downsample=[False], latents_mean=[0.0] * 4,
                                           latents_std=[1.0] * 4).eval()
    return diffusers.QwenImagePipeline(
        transformer=transformer, vae=vae, text_encoder=qwen_text_encoder(seed), tokenizer=byte_level_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def save_qwen_image(root: Path) -> Path:
    folder = root / "qwen-image"
    qwen_image_pipeline().save_pretrained(folder)
    return folder


QWEN_CALL = dict(prompt="a red lighthouse", height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0,
                 output_type="pt", max_sequence_length=64)
