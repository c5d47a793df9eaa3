"""The variants that take an image (or a control image): img2img, inpaint, the SDXL refiner, ControlNet
(SD 1.x/2.x, SDXL, FLUX.1), FLUX.1 Img2Img, Inpaint, Fill and Kontext, and Wan VACE.

What each adds to its base family's call (`unet_families`, `dit_families`, `video_families`):
- the VAE *encodes* the input image at the call's size before it decodes the result (img2img, inpaint, Fill,
  Kontext, and FLUX ControlNets without a pixel hint block); its peak is the larger of the two. The call's
  height and width are the image's (SD/SDXL img2img take the size from the image).
- inpaint and Fill: the denoiser's extra input channels (mask and masked-image latents) are in its
  `in_channels` already (9 for an inpainting UNet, 384 for FLUX.1-Fill), which the base call reads.
- Kontext: the conditioning image's packed latents are appended to the latent tokens (the sequence doubles for
  an image of the output's size, which the call plans for).
- ControlNet: the ControlNet runs on the denoiser's batch every step, on the control image (pixels, or its
  packed VAE latents for FLUX), and hands its residuals to the denoiser: they are the ControlNet's output and
  the denoiser's input, counted in both.
- Wan VACE: the VAE encodes the control video twice (inactive and reactive parts) and its reference frames; the
  transformer takes `vace_in_channels` of control latents next to the noise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from torch import nn

from . import dit_families, unet_families, video_families
from .shapes import config_value, float32, floats, tokens
from .spec import CallSpec, CallSpecError, ExampleCall

Calls = dict[str, tuple[ExampleCall, ...]]


def with_image_encode(calls: Calls, modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """`calls` with the VAE encoding the input image first."""
    return {**calls, "vae": (unet_families.image_encode(modules["vae"], spec), *calls["vae"])}


def sd_with_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline (1.x/2.x)."""
    return with_image_encode(unet_families.stable_diffusion(modules, spec), modules, spec)


def sdxl_with_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionXLImg2ImgPipeline (the refiner too), StableDiffusionXLInpaintPipeline."""
    return with_image_encode(unet_families.stable_diffusion_xl(modules, spec), modules, spec)


def flux_with_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """FluxImg2ImgPipeline, FluxInpaintPipeline, FluxFillPipeline (its 384 input channels: `in_channels`)."""
    return with_image_encode(dit_families.flux(modules, spec), modules, spec)


def flux_kontext(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """FluxKontextPipeline: the image's packed latents appended to the latent tokens (module doc)."""
    calls = dit_families.flux(modules, spec, context_tokens=dit_families.packed_tokens(modules, spec))
    return with_image_encode(calls, modules, spec)


# --------------------------------------------------------------------------------------------- ControlNet
def unet_residuals(controlnet: nn.Module, like: nn.Module, batch: int, rows: int, cols: int):
    """ControlNetModel's outputs, as the UNet takes them: one residual per down-path output (conv_in, each
    layer of each block, each downsampler) and one for the mid block."""
    config = controlnet.config
    channels, layers = config.block_out_channels, config.layers_per_block
    residuals = [floats(like, batch, channels[0], rows, cols)]
    for index, width in enumerate(channels):
        count = layers if isinstance(layers, int) else layers[index]
        residuals += [floats(like, batch, width, rows, cols) for _ in range(count)]
        if index < len(channels) - 1:
            rows, cols = (rows + 1) // 2, (cols + 1) // 2  # a stride-2 conv with padding 1
            residuals.append(floats(like, batch, width, rows, cols))
    return residuals, floats(like, batch, channels[-1], rows, cols)


def one_controlnet(modules: Mapping[str, nn.Module]) -> nn.Module:
    """The pipeline's ControlNet; several (a Multi-ControlNet, without a config of its own) are not described."""
    controlnet = modules["controlnet"]
    if getattr(controlnet, "config", None) is None:
        raise CallSpecError(f"call= describes one ControlNet; this pipeline's controlnet is a "
                            f"{type(controlnet).__name__}. Plan without call= (weights only), or give the peaks "
                            "yourself with placement.plan(activations=...).")
    return controlnet


def _unet_controlnet(base: Calls, modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    unet_call = base["unet"][0]
    latents, timestep = unet_call.args
    controlnet, batch, rows, cols = one_controlnet(modules), latents.shape[0], *latents.shape[-2:]
    extra = {"added_cond_kwargs": unet_call.kwargs["added_cond_kwargs"]} \
        if "added_cond_kwargs" in unet_call.kwargs else {}
    control = floats(controlnet, batch, config_value(controlnet, "conditioning_channels", default=3), spec.height,
                     spec.width)
    sample = floats(controlnet, batch, controlnet.config.in_channels, rows, cols)  # inpaint: no mask channels
    controlnet_call = ExampleCall(args=(sample, floats(controlnet)), kwargs={
        "encoder_hidden_states": floats(controlnet, *unet_call.kwargs["encoder_hidden_states"].shape),
        "controlnet_cond": control, "conditioning_scale": 1.0, "guess_mode": False, "return_dict": False, **extra})
    down, mid = unet_residuals(controlnet, modules["unet"], batch, rows, cols)
    unet_call = replace(unet_call, kwargs={**unet_call.kwargs, "down_block_additional_residuals": down,
                                           "mid_block_additional_residual": mid})
    return {**base, "unet": (unet_call,), "controlnet": (controlnet_call,)}


def sd_controlnet(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionControlNetPipeline: one ControlNetModel on the pixel control image."""
    return _unet_controlnet(unet_families.stable_diffusion(modules, spec), modules, spec)


def sdxl_controlnet(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionXLControlNetPipeline: as SD's, with SDXL's added conditions for the ControlNet too."""
    return _unet_controlnet(unet_families.stable_diffusion_xl(modules, spec), modules, spec)


def sd_controlnet_with_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionControlNetImg2ImgPipeline, StableDiffusionControlNetInpaintPipeline."""
    return with_image_encode(sd_controlnet(modules, spec), modules, spec)


def sdxl_controlnet_with_image(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """StableDiffusionXLControlNetImg2ImgPipeline, StableDiffusionXLControlNetInpaintPipeline."""
    return with_image_encode(sdxl_controlnet(modules, spec), modules, spec)


def flux_controlnet(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """FluxControlNetPipeline: a FluxControlNetModel per step on the packed latents, its block samples fed to
    the transformer; the control image VAE-encoded and packed unless the ControlNet has a pixel hint block."""
    calls = dit_families.flux(modules, spec)
    transformer_call = calls["transformer"][0]
    controlnet, transformer = one_controlnet(modules), modules["transformer"]
    latents = transformer_call.args[0]
    batch, image_tokens = latents.shape[0], latents.shape[1]
    hint = isinstance(getattr(controlnet, "input_hint_block", None), nn.Module)
    control = floats(controlnet, batch, 3, spec.height, spec.width) if hint else \
        floats(controlnet, batch, image_tokens, config_value(controlnet, "in_channels"))
    given = transformer_call.kwargs
    kwargs = {"encoder_hidden_states": floats(controlnet, *given["encoder_hidden_states"].shape),
              "pooled_projections": floats(controlnet, *given["pooled_projections"].shape),
              "timestep": floats(controlnet, batch), "img_ids": given["img_ids"], "txt_ids": given["txt_ids"],
              "controlnet_cond": control, "conditioning_scale": 1.0, "return_dict": False}
    if config_value(controlnet, "guidance_embeds", default=False):
        kwargs["guidance"] = float32(batch)
    if config_value(controlnet, "num_mode") is not None:  # ControlNet-Union: one mode per image
        kwargs["controlnet_mode"] = tokens(batch, 1)
    calls["controlnet"] = (ExampleCall(args=(floats(controlnet, *latents.shape),), kwargs=kwargs),)
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    samples = {"controlnet_block_samples": config_value(controlnet, "num_layers", default=0),
               "controlnet_single_block_samples": config_value(controlnet, "num_single_layers", default=0)}
    extra = {key: [floats(transformer, batch, image_tokens, inner) for _ in range(count)] or None
             for key, count in samples.items()}
    calls["transformer"] = (replace(transformer_call, kwargs={**transformer_call.kwargs, **extra,
                                                              "controlnet_blocks_repeat": hint}),)
    return calls if hint else with_image_encode(calls, modules, spec)


# ------------------------------------------------------------------------------------------------ Wan VACE
def wan_vace(modules: Mapping[str, nn.Module], spec: CallSpec) -> Calls:
    """WanVACEPipeline: Wan T2V plus the control video's latents (`vace_in_channels`) for the VACE blocks, and
    the VAE encoding that video (inactive and reactive halves: two encodes of the full video) before decoding."""
    vae, transformer = modules["vae"], modules["transformer"]
    frames, rows, cols = video_families.grid(vae, spec)
    batch = spec.images
    layers = len(config_value(transformer, "vace_layers", default=()))
    control = {
        "control_hidden_states": lambda module, b: floats(module, b, config_value(module, "vace_in_channels"),
                                                          frames, rows, cols),
        "control_hidden_states_scale": lambda module, b: floats(module, max(layers, 1)),
    }
    calls = video_families.wan_with(modules, spec, control)
    video = floats(vae, batch, 3, spec.num_frames, spec.height, spec.width)
    calls["vae"] = (ExampleCall(args=(video,), method="encode"), *calls["vae"])
    return calls
