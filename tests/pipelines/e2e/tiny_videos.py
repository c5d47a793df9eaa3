"""Tiny video pipelines (CogVideoX, LTX-Video, LTX-2, HunyuanVideo and 1.5, Mochi, Wan 2.1 I2V, Wan VACE, Wan 2.2,
SkyReels V2), built by diffusers from `tiny_parts` at the sizes of diffusers' own tests."""

from __future__ import annotations

import diffusers
import transformers

from tiny_parts import (LLM_VOCAB, WAN_TRANSFORMER, clip_config, clip_tokenizer, llm_tokenizer, seeded, t5_encoder,
                        t5_tokenizer, wan_vae)


def cogvideox(root):
    return diffusers.CogVideoXPipeline(
        transformer=seeded(lambda: diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
            text_embed_dim=32, num_layers=1, sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
            temporal_compression_ratio=4, max_text_seq_length=8)),
        vae=seeded(lambda: diffusers.AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
            layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4, sample_size=tile)),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(), scheduler=diffusers.DDIMScheduler())


def ltx(root):
    vae = seeded(lambda: diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False))
    return diffusers.LTXPipeline(
        transformer=seeded(lambda: diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
            cross_attention_dim=32, num_layers=1, caption_channels=32)),
        vae=vae, text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def hunyuan_video(root):
    llama = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=16,
                                     intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                     vocab_size=LLM_VOCAB, hidden_act="gelu")
    return diffusers.HunyuanVideoPipeline(
        transformer=seeded(lambda: diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=32, rope_axes_dim=(2, 4, 4))),
        vae=seeded(lambda: diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
            temporal_compression_ratio=4, mid_block_add_attention=True)),
        text_encoder=seeded(lambda: transformers.LlamaModel(llama)), tokenizer=llm_tokenizer("LlamaTokenizerFast"),
        # the pipeline pads CLIP prompts to 77 tokens, whatever its tokenizer says
        text_encoder_2=seeded(lambda: transformers.CLIPTextModel(clip_config(max_position_embeddings=77))),
        tokenizer_2=clip_tokenizer(root / "vocab"),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def wan_i2v(root):
    vision = transformers.CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, intermediate_size=16, patch_size=8)
    return diffusers.WanImageToVideoPipeline(
        transformer=seeded(lambda: diffusers.WanTransformer3DModel(**{**WAN_TRANSFORMER, "in_channels": 36},
                                                                   image_dim=4)),
        vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), image_encoder=seeded(lambda: transformers.CLIPVisionModel(vision)),
        image_processor=transformers.CLIPImageProcessor(crop_size=32, size=32),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def wan_vace(root):
    return diffusers.WanVACEPipeline(
        transformer=seeded(lambda: diffusers.WanVACETransformer3DModel(
            **{**WAN_TRANSFORMER, "num_layers": 3}, vace_layers=[0, 2], vace_in_channels=96)),
        vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def wan22(root):
    """Wan 2.2 text-to-video: two experts, the high-noise one (`transformer`) until the timestep falls under
    `boundary_ratio` of the schedule, then the low-noise one (`transformer_2`)."""
    return diffusers.WanPipeline(
        transformer=seeded(lambda: diffusers.WanTransformer3DModel(**WAN_TRANSFORMER)),
        transformer_2=seeded(lambda: diffusers.WanTransformer3DModel(**{**WAN_TRANSFORMER, "num_layers": 1})),
        boundary_ratio=0.875, vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


def ltx2(root):
    """LTX-2 (video and audio): a Gemma 3 encoder whose every layer's states feed `connectors`, a class of the
    pipeline's own module (diffusers saves it as ["ltx2", "LTX2TextConnectors"]), and an audio VAE and vocoder."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    text = transformers.Gemma3TextConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_hidden_layers=2, vocab_size=LLM_VOCAB, sliding_window=4, max_position_embeddings=64)
    vision = transformers.SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                             num_hidden_layers=1, image_size=8, patch_size=4)
    gemma = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1,
                                      image_token_index=LLM_VOCAB - 1, boi_token_index=LLM_VOCAB - 2,
                                      eoi_token_index=LLM_VOCAB - 3)
    heads = dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, num_learnable_registers=None)
    return diffusers.LTX2Pipeline(
        transformer=seeded(lambda: diffusers.LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
            rope_double_precision=False, rope_type="split")),
        connectors=seeded(lambda: LTX2TextConnectors(
            caption_channels=16, text_proj_in_factor=text.num_hidden_layers + 1, connector_rope_base_seq_len=32,
            rope_double_precision=False, rope_type="split",
            **{f"{stream}_connector_{key}": value for stream in ("video", "audio") for key, value in heads.items()})),
        vae=seeded(lambda: diffusers.AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False)),
        audio_vae=seeded(lambda: diffusers.AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, mel_bins=8)),
        vocoder=seeded(lambda: LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            output_sampling_rate=16000)),
        text_encoder=seeded(lambda: transformers.Gemma3ForConditionalGeneration(gemma).eval()),
        tokenizer=llm_tokenizer("GemmaTokenizerFast"), scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def mochi(root):
    return diffusers.MochiPipeline(
        transformer=seeded(lambda: diffusers.MochiTransformer3DModel(
            patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
            in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
            activation_fn="swiglu", max_sequence_length=16)),
        vae=seeded(lambda: diffusers.AutoencoderKLMochi(
            latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1))),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def hunyuan_video15(root):
    """HunyuanVideo 1.5 text-to-video: a Qwen2.5-VL text model prompted as a chat, and a ByT5 glyph encoder."""
    from diffusers.guiders import ClassifierFreeGuidance

    qwen = transformers.Qwen2_5_VLTextConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=LLM_VOCAB, bos_token_id=1, eos_token_id=2,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
    return diffusers.HunyuanVideo15Pipeline(
        transformer=seeded(lambda: diffusers.HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
            image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")),
        vae=seeded(lambda: diffusers.AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
            upsample_match_channel=False)),
        text_encoder=seeded(lambda: transformers.Qwen2_5_VLTextModel(qwen).eval()),
        tokenizer=llm_tokenizer("Qwen2TokenizerFast", chat=True),
        text_encoder_2=seeded(t5_encoder), tokenizer_2=transformers.ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def skyreels_v2(root):
    return diffusers.SkyReelsV2Pipeline(
        transformer=seeded(lambda: diffusers.SkyReelsV2Transformer3DModel(**WAN_TRANSFORMER)),
        vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), scheduler=diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True))


def allegro(root, *, tile: int = 128):
    """Allegro: its VAE decodes only in tiles (without tiling its decode raises NotImplementedError; diffusers' own
    tests turn tiling on). Tiles of 24 frames x `tile` (its `sample_size`) pixels, overlapping by 8 frames x 120
    (80) pixels: 128 decodes a 128x128x24 call as one tile; the published 320 (also diffusers' test default, which
    decodes its 16 px call as no tile at all: blank frames) a 720x1280x88 one as 75 (128 would make it 9375)."""
    return diffusers.AllegroPipeline(
        transformer=seeded(lambda: diffusers.AllegroTransformer3DModel(
            num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=1,
            cross_attention_dim=24, sample_width=8, sample_height=8, sample_frames=8, caption_channels=32)),
        vae=seeded(lambda: diffusers.AutoencoderKLAllegro(
            in_channels=3, out_channels=3, down_block_types=("AllegroDownBlock3D",) * 4,
            up_block_types=("AllegroUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
            layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4, sample_size=tile)),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(), scheduler=diffusers.DDIMScheduler())


def skyreels_v2_df(root):
    """SkyReels V2 diffusion forcing: a timestep per latent frame (`enable_diffusion_forcing`), the same parts."""
    return diffusers.SkyReelsV2DiffusionForcingPipeline(
        transformer=seeded(lambda: diffusers.SkyReelsV2Transformer3DModel(**WAN_TRANSFORMER)),
        vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), scheduler=diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True))
