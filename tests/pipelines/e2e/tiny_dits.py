"""Tiny image DiT pipelines (PixArt-Sigma, Sana, Qwen-Image, SD3 without T5, AuraFlow, Lumina2, Z-Image, the
FLUX.1 variants, FLUX.2 klein, HiDream), built by diffusers from `tiny_parts` at the sizes of diffusers' own tests."""

from __future__ import annotations

import diffusers
import torch
import transformers

from tiny_parts import (LLM_VOCAB, clip_config, clip_tokenizer, flow_vae, flux_transformer, gemma2_encoder,
                        llm_tokenizer, seeded, t5_encoder, t5_tokenizer)


# ---------------------------------------------------------------------------------------------- image DiTs
def pixart(root):
    return diffusers.PixArtSigmaPipeline(
        transformer=seeded(lambda: diffusers.PixArtTransformer2DModel(
            sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=3,
            caption_channels=32, in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6)),
        vae=seeded(lambda: flow_vae(4)), text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(),
        scheduler=diffusers.DDIMScheduler())


def sana(root):
    vae = seeded(lambda: diffusers.AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407))
    return diffusers.SanaPipeline(
        transformer=seeded(lambda: diffusers.SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
            num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
            sample_size=32)),
        vae=vae, text_encoder=seeded(gemma2_encoder), tokenizer=llm_tokenizer("GemmaTokenizerFast"),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def qwen_image(root):
    config = transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": LLM_VOCAB,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=LLM_VOCAB)
    return diffusers.QwenImagePipeline(
        transformer=seeded(lambda: diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=3,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))),
        vae=seeded(lambda: diffusers.AutoencoderKLQwenImage(
            base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)),
        text_encoder=seeded(lambda: transformers.Qwen2_5_VLForConditionalGeneration(config).eval()),
        tokenizer=llm_tokenizer("Qwen2TokenizerFast"), scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def sd3_without_t5(root):
    tokenizer = clip_tokenizer(root / "vocab")
    return diffusers.StableDiffusion3Pipeline(
        transformer=seeded(lambda: diffusers.SD3Transformer2DModel(
            sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)),
        text_encoder=seeded(lambda: transformers.CLIPTextModelWithProjection(clip_config())), tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: transformers.CLIPTextModelWithProjection(clip_config())), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None, vae=seeded(lambda: flow_vae(4)),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def aura_flow(root):
    return diffusers.AuraFlowPipeline(
        transformer=seeded(lambda: diffusers.AuraFlowTransformer2DModel(
            sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
            out_channels=4, pos_embed_max_size=256)),
        text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)), tokenizer=t5_tokenizer(),
        vae=seeded(lambda: flow_vae(4)), scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def lumina2(root):
    return diffusers.Lumina2Pipeline(
        transformer=seeded(lambda: diffusers.Lumina2Transformer2DModel(
            sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=1, num_attention_heads=1,
            num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
            axes_dim_rope=[4, 2, 2], cap_feat_dim=8)),
        vae=seeded(lambda: flow_vae(4)), text_encoder=seeded(gemma2_encoder),
        tokenizer=llm_tokenizer("GemmaTokenizerFast"), scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


# --------------------------------------------------------------------------------------------------- FLUX
def _flux_parts(root, *, in_channels=4, latent_channels=1):
    return dict(transformer=seeded(lambda: flux_transformer(in_channels)),
                text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())),
                tokenizer=clip_tokenizer(root / "vocab"), text_encoder_2=seeded(t5_encoder),
                tokenizer_2=t5_tokenizer(), vae=seeded(lambda: flow_vae(latent_channels)),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def flux_img2img(root):
    return diffusers.FluxImg2ImgPipeline(**_flux_parts(root))


def flux_inpaint(root):
    return diffusers.FluxInpaintPipeline(**_flux_parts(root))


def flux_kontext(root):
    return diffusers.FluxKontextPipeline(**_flux_parts(root))


def flux_fill(root):
    # 4 packed latent channels, 4 of the masked image's, 4 of the mask (a VAE without downsampling): 12.
    parts = _flux_parts(root, in_channels=12)
    parts["transformer"] = seeded(lambda: flux_transformer(12, out_channels=4))
    return diffusers.FluxFillPipeline(**parts)


def flux_controlnet(root):
    controlnet = seeded(lambda: diffusers.FluxControlNetModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]))
    return diffusers.FluxControlNetPipeline(**_flux_parts(root), controlnet=controlnet)


def z_image(root):
    """Z-Image: a Qwen3 text encoder, and a transformer with parameters at its root (`x_pad_token`,
    `cap_pad_token`), which diffusers' own test fixes to ones (torch.empty would give NaNs)."""
    transformer = seeded(lambda: diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]))
    with torch.no_grad():
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    tokenizer = llm_tokenizer("Qwen2TokenizerFast")
    tokenizer.chat_template = CHAT_TEMPLATE
    return diffusers.ZImagePipeline(
        transformer=transformer, vae=seeded(lambda: flow_vae(16)), tokenizer=tokenizer,
        text_encoder=seeded(lambda: transformers.Qwen3Model(transformers.Qwen3Config(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=LLM_VOCAB, max_position_embeddings=512)).eval()),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


# The smallest chat template Z-Image's prompt encoding accepts: each message's text, then the generation prompt.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")


def sd3_controlnet(root):
    """SD3 with a ControlNet: the transformer adds the ControlNet's residuals to its hidden state between blocks,
    in its own forward (three blocks: the last takes no residual, so a split puts two on two devices)."""
    parts = sd3_without_t5(root).components
    transformer_config = dict(sample_size=32, patch_size=1, in_channels=4, attention_head_dim=8,
                              num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                              pooled_projection_dim=64, out_channels=4)
    parts["transformer"] = seeded(lambda: diffusers.SD3Transformer2DModel(num_layers=3, **transformer_config))
    parts["controlnet"] = seeded(lambda: diffusers.SD3ControlNetModel(num_layers=1, **transformer_config))
    return diffusers.StableDiffusion3ControlNetPipeline(**parts)


# -------------------------------------------------------------------- classes the family table never described
def chroma(root):
    return diffusers.ChromaPipeline(
        transformer=seeded(lambda: diffusers.ChromaTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32,
            approximator_layers=1, approximator_num_channels=16)),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(), vae=seeded(lambda: flow_vae(1)),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


# What GLM-4's tokenizer puts before every text, as CogView4's published one does: without it the default negative
# prompt "" is no token at all, and GLM cannot run on an empty sequence (diffusers' own call fails alike).
GLM_PREFIX = ("[gMASK]", "<sop>")


def cogview4(root):
    glm = transformers.GlmConfig(hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                                 head_dim=8, vocab_size=LLM_VOCAB, pad_token_id=0)
    return diffusers.CogView4Pipeline(
        transformer=seeded(lambda: diffusers.CogView4Transformer2DModel(
            patch_size=2, in_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=4, out_channels=4,
            text_embed_dim=32, time_embed_dim=8, condition_dim=4)),
        vae=seeded(lambda: flow_vae(4)), text_encoder=seeded(lambda: transformers.GlmModel(glm).eval()),
        tokenizer=llm_tokenizer("PreTrainedTokenizerFast", prefix=GLM_PREFIX),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                            use_dynamic_shifting=True, time_shift_type="linear"))


def sana_sprint(root):
    parts = sana(root)
    return diffusers.SanaSprintPipeline(
        transformer=seeded(lambda: diffusers.SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
            num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
            sample_size=32, qk_norm="rms_norm_across_heads", guidance_embeds=True)),
        vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer, scheduler=diffusers.SCMScheduler())


def flux2_klein(root):
    """FLUX.2 klein: a Qwen3 prompted as a chat, the states of chosen layers (`text_encoder_out_layers`)."""
    qwen3 = transformers.Qwen3Config(intermediate_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=LLM_VOCAB, max_position_embeddings=512)
    return diffusers.Flux2KleinPipeline(
        transformer=seeded(lambda: diffusers.Flux2Transformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
            guidance_embeds=False)),
        text_encoder=seeded(lambda: transformers.Qwen3ForCausalLM(qwen3).eval()),
        tokenizer=llm_tokenizer("Qwen2TokenizerFast", chat=True),
        vae=seeded(lambda: diffusers.AutoencoderKLFlux2(
            sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
            norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def hidream(root):
    """HiDream-I1: two CLIPs, a T5 and a Llama whose chosen layers feed the MoE transformer's blocks."""
    clip = clip_config(max_position_embeddings=128, vocab_size=1000)
    llama = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=16,
                                     intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                     vocab_size=LLM_VOCAB)
    return diffusers.HiDreamImagePipeline(
        transformer=seeded(lambda: diffusers.HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=64, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1)).eval()),
        vae=seeded(lambda: diffusers.AutoencoderKL(scaling_factor=0.3611, shift_factor=0.1159)),
        text_encoder=seeded(lambda: transformers.CLIPTextModelWithProjection(clip).eval()),
        tokenizer=clip_tokenizer(root / "vocab"),
        text_encoder_2=seeded(lambda: transformers.CLIPTextModelWithProjection(clip).eval()),
        tokenizer_2=clip_tokenizer(root / "vocab"), text_encoder_3=seeded(t5_encoder), tokenizer_3=t5_tokenizer(),
        text_encoder_4=seeded(lambda: transformers.LlamaForCausalLM(llama).eval()),
        tokenizer_4=llm_tokenizer("PreTrainedTokenizerFast"), scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def cogview3plus(root):
    """CogView 3 Plus at the sizes of diffusers' own test (a T5 encoder, an AutoencoderKL, CogVideoX's DDIM)."""
    return diffusers.CogView3PlusPipeline(
        transformer=seeded(lambda: diffusers.CogView3PlusTransformer2DModel(
            patch_size=2, in_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=2, out_channels=4,
            text_embed_dim=32, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8, sample_size=8)),
        vae=seeded(lambda: diffusers.AutoencoderKL(
            block_out_channels=[32, 64], in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, sample_size=128)),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(), scheduler=diffusers.CogVideoXDDIMScheduler())
