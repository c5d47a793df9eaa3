"""Tiny components the end-to-end pipelines are built from, all without the network: tokenizers built from a
vocabulary written here (CLIP's BPE, T5's unigram, a byte-level BPE for the LLM tokenizers), text encoders,
VAEs and denoisers at the smallest sizes diffusers' own tests use (tests/pipelines/*/test_*.py,
`get_dummy_components`)."""

from __future__ import annotations

import diffusers
import torch
import transformers

# The CLIP and T5 tokenizers are the real presets' stand-ins (and the benchmarks').
from pipelines.presets import real_folders as _real_folders

CLIP_LENGTH = 16  # the tiny CLIPs' position table, and their tokenizers' padding length


def clip_tokenizer(folder):
    return _real_folders.clip_tokenizer(folder, CLIP_LENGTH)


def t5_tokenizer():
    return _real_folders.t5_tokenizer()


# A chat template for the pipelines that prompt their LLM as a chat (FLUX.2 klein, HunyuanVideo 1.5): each
# message's text between <s> and </s>, then an open <s> for the answer.
CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['content'] if message['content'] is string else "
                 "message['content'][0]['text'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}")


def llm_tokenizer(class_name: str, *, prefix: tuple[str, ...] = (), chat: bool = False):
    """A byte-level BPE without merges (one token per byte) in the class an LLM pipeline expects; `prefix`: special
    tokens it puts before every text, as GLM's puts `[gMASK]<sop>` (so an empty prompt is two tokens, not none);
    `chat`: with `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>", *prefix]
    vocab = {token: index for index, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if prefix:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A"]), special_tokens=[(token, vocab[token]) for token in prefix])
    return getattr(transformers, class_name)(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                             pad_token="<pad>", unk_token="<unk>",
                                             **({"chat_template": CHAT_TEMPLATE} if chat else {}))


LLM_VOCAB = 300  # above the byte-level tokenizer's 260 ids


def clip_config(**overrides):
    return transformers.CLIPTextConfig(**{
        "hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 55, "max_position_embeddings": CLIP_LENGTH, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 1, "projection_dim": 32, **overrides})


def t5_encoder(cls=None):
    cls = cls or transformers.T5EncoderModel
    config_class = transformers.UMT5Config if cls is transformers.UMT5EncoderModel else transformers.T5Config
    return cls(config_class(vocab_size=60, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)).eval()


def gemma2_encoder(hidden: int = 8):
    return transformers.Gemma2Model(transformers.Gemma2Config(
        head_dim=4, hidden_size=hidden, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1,
        num_key_value_heads=2, vocab_size=LLM_VOCAB, sliding_window=4)).eval()


def flow_vae(latent_channels, *, sample_size=32):
    """An AutoencoderKL with one block (no downsampling), as diffusers' FLUX tests build it."""
    return diffusers.AutoencoderKL(
        sample_size=sample_size, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035)


def sd_unet(**overrides):
    return diffusers.UNet2DConditionModel(**{
        "block_out_channels": (4, 8), "layers_per_block": 1, "sample_size": 8, "in_channels": 4, "out_channels": 4,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "cross_attention_dim": 32, "norm_num_groups": 1,
        "attention_head_dim": 4, **overrides})


SDXL_UNET = dict(
    block_out_channels=(2, 4), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80, cross_attention_dim=64,
    norm_num_groups=1)


def sdxl_unet(**overrides):
    return diffusers.UNet2DConditionModel(**{**SDXL_UNET, **overrides})


def flux_transformer(in_channels=4, **overrides):
    return diffusers.FluxTransformer2DModel(**{
        "patch_size": 1, "in_channels": in_channels, "num_layers": 1, "num_single_layers": 1,
        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
        "axes_dims_rope": [4, 4, 8], **overrides})


def wan_vae():
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                      temperal_downsample=[False, True, True])


# rope_max_seq_len as the published Wan and SkyReels V2 configs (diffusers' default): its rotary table has a row per
# latent patch along each axis, and a tiny table (diffusers' tests use 32) makes the model's own code refuse real
# sizes (544 px is 34 patches high: `view(1, 34, 1, -1)` of 32 rows), in diffusers' run as in the plan's.
WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                       out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                       qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)


def seeded(make):
    """`make()` with the global seed reset, so every folder's random weights are the same at every build."""
    torch.manual_seed(0)
    return make()
