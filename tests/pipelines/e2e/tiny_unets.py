"""Tiny UNet pipelines (Stable Diffusion 1.x/2.x and SDXL with their img2img, inpaint, refiner and ControlNet
variants), built by diffusers from `tiny_parts`."""

from __future__ import annotations

import diffusers
import transformers

from tiny_parts import (SDXL_UNET, clip_config, clip_tokenizer, flow_vae, sd_unet, sdxl_unet, seeded, t5_encoder,
                        t5_tokenizer)


def _sd_parts(root, *, in_channels=4):
    return dict(vae=seeded(lambda: flow_vae(4)),
                text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())),
                tokenizer=clip_tokenizer(root / "vocab"), unet=seeded(lambda: sd_unet(in_channels=in_channels)),
                scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1), safety_checker=None,
                feature_extractor=None, requires_safety_checker=False)


def sd_img2img(root):
    return diffusers.StableDiffusionImg2ImgPipeline(**_sd_parts(root))


def sd_inpaint(root):
    return diffusers.StableDiffusionInpaintPipeline(**_sd_parts(root, in_channels=9))  # an inpainting UNet


def sd_controlnet(root):
    controlnet = seeded(lambda: diffusers.ControlNetModel(
        block_out_channels=(4, 8), layers_per_block=1, in_channels=4, cross_attention_dim=32, norm_num_groups=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), attention_head_dim=4,
        conditioning_embedding_out_channels=(16,)))  # one stage: the control image at the latents' size
    return diffusers.StableDiffusionControlNetPipeline(**_sd_parts(root), controlnet=controlnet)


def _sdxl_parts(root, *, in_channels=4):
    tokenizer = clip_tokenizer(root / "vocab")
    return dict(unet=seeded(lambda: sdxl_unet(in_channels=in_channels)), vae=seeded(lambda: flow_vae(4)),
                text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())), tokenizer=tokenizer,
                text_encoder_2=seeded(lambda: transformers.CLIPTextModelWithProjection(clip_config())),
                tokenizer_2=tokenizer, scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1))


def sdxl_img2img(root):
    return diffusers.StableDiffusionXLImg2ImgPipeline(**_sdxl_parts(root))


def sdxl_refiner(root):
    """The refiner's layout: text_encoder_2 alone (its 32-wide states), 5 time ids with the aesthetic score."""
    parts = _sdxl_parts(root)
    parts.update(text_encoder=None, tokenizer=None, requires_aesthetics_score=True,
                 unet=seeded(lambda: sdxl_unet(cross_attention_dim=32, projection_class_embeddings_input_dim=72)))
    return diffusers.StableDiffusionXLImg2ImgPipeline(**parts)


def sdxl_inpaint(root):
    return diffusers.StableDiffusionXLInpaintPipeline(**_sdxl_parts(root, in_channels=9))


def sdxl_controlnet(root):
    controlnet = seeded(lambda: diffusers.ControlNetModel(
        **{key: value for key, value in SDXL_UNET.items() if key not in ("up_block_types", "out_channels",
                                                                          "sample_size")},
        conditioning_embedding_out_channels=(16,)))
    return diffusers.StableDiffusionXLControlNetPipeline(**_sdxl_parts(root), controlnet=controlnet)


def animatediff(root):
    """AnimateDiff: diffusers joins the U-Net and the motion adapter into a `UNetMotionModel`, whose up blocks
    concatenate the hidden state with skip connections from the down path (sizes of diffusers' own test)."""
    unet = seeded(lambda: diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2))
    adapter = seeded(lambda: diffusers.MotionAdapter(
        block_out_channels=(32, 64), motion_layers_per_block=2, motion_norm_num_groups=2, motion_num_attention_heads=4))
    return diffusers.AnimateDiffPipeline(
        unet=unet, motion_adapter=adapter, vae=seeded(lambda: flow_vae(4)), tokenizer=clip_tokenizer(root / "vocab"),
        text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())),
        scheduler=diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear",
                                          clip_sample=False), feature_extractor=None, image_encoder=None)


def kandinsky3(root):
    """Kandinsky 3: a T5 encoder and a U-Net whose attention takes the text mask made once in its forward (the
    sizes of diffusers' own test; the MoVQ decoder's spatial norm conditions on the latents)."""
    return diffusers.Kandinsky3Pipeline(
        unet=seeded(lambda: diffusers.Kandinsky3UNet(
            in_channels=4, time_embedding_dim=4, groups=2, attention_head_dim=4, layers_per_block=3,
            block_out_channels=(32, 64), cross_attention_dim=4, encoder_hid_dim=32)),
        movq=seeded(lambda: diffusers.VQModel(
            block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
            in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
            num_vq_embeddings=12, out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
            vq_embed_dim=4)),
        text_encoder=seeded(t5_encoder), tokenizer=t5_tokenizer(),
        scheduler=diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1, clip_sample=True,
                                          beta_schedule="squaredcos_cap_v2", thresholding=False))
