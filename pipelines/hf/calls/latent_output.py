"""A denoiser's or an image VAE's output when its call cannot be estimated at all: call capture passes each
component's output to the pipeline's next step, and where neither the estimate nor its run with guessed values gives
one (`placement.activations.fallback`), a diffusers denoiser's output is still known from its inputs: the noise (or
velocity) prediction has its latents' shape, with the model's `out_channels` in place of its `in_channels`; and so
is an image VAE's `decode` of 4-d latents with the VAE's `latent_channels`: `out_channels` at each side times the
VAE's scale factor (2 per block of `block_out_channels` beyond the first, diffusers' `vae_scale_factor`). A video
VAE's frames depend on its temporal rule, so it gets none.

Only a `forward` whose latents input (`hidden_states` or `sample`, else the first tensor argument) carries the
model's `config.in_channels` on its channel axis (1, or last for packed latents) gets one; any other call raises
as before. The pipeline's own code then checks the guess: an output of the wrong structure makes the capture
fail, naming the component whose output was guessed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

_LATENT_KEYWORDS = ("hidden_states", "sample")


@dataclass(frozen=True)
class LatentsShapedOutput:
    """The guessed output, as the call returns it, and what it was taken from, for a person."""

    output: Any
    taken_from: str


def latents_shaped_output(module: nn.Module, method: str, args: tuple, kwargs: Mapping[str, Any],
                          dtype: torch.dtype | None) -> LatentsShapedOutput | None:
    """The output of `module.<method>(*args, **kwargs)` as a denoiser's (module doc), on meta; None where the
    call is not a denoiser's forward on latents of the model's channels."""
    config = getattr(module, "config", None)
    if method == "decode":
        return _decoded_image(config, args, kwargs, dtype)
    in_channels = _int(getattr(config, "in_channels", None))
    if method != "forward" or in_channels is None:
        return None
    name, latents = _latents(args, kwargs)
    if latents is None or latents.numel() == 0:  # an empty batch is the call's fault, not a shape to guess from
        return None
    axis = next((axis for axis in (1, latents.dim() - 1) if 0 < axis < latents.dim()
                 and latents.shape[axis] == in_channels), None)
    if axis is None:
        return None
    shape = list(latents.shape)
    shape[axis] = _int(getattr(config, "out_channels", None)) or in_channels
    prediction = torch.empty(shape, dtype=dtype or latents.dtype, device="meta")
    taken_from = (f"its latents' shape ({name} {_described(latents)} -> {_described(prediction)}, "
                  f"out_channels on axis {axis})")
    return LatentsShapedOutput(output=_as_returned(prediction, kwargs), taken_from=taken_from)


def _decoded_image(config: Any, args: tuple, kwargs: Mapping[str, Any],
                   dtype: torch.dtype | None) -> LatentsShapedOutput | None:
    """An image VAE's decode of 4-d latents with its `latent_channels` (module doc); None for anything else."""
    latent_channels = _int(getattr(config, "latent_channels", None))
    out_channels = _int(getattr(config, "out_channels", None))
    blocks = getattr(config, "block_out_channels", None)
    name, latents = _latents(args, {"sample": kwargs.get("z", kwargs.get("sample"))})
    if None in (latent_channels, out_channels, latents) or not isinstance(blocks, (list, tuple)) or not blocks \
            or latents.dim() != 4 or latents.shape[1] != latent_channels or latents.numel() == 0:
        return None
    scale = 2 ** (len(blocks) - 1)
    batch, _, height, width = latents.shape
    image = torch.empty(batch, out_channels, height * scale, width * scale, dtype=dtype or latents.dtype,
                        device="meta")
    taken_from = (f"its latents' shape ({name} {_described(latents)} -> {_described(image)}, out_channels at "
                  f"{scale}x each side)")
    if kwargs.get("return_dict", True) is False:
        return LatentsShapedOutput(output=(image,), taken_from=taken_from)
    from diffusers.models.autoencoders.vae import DecoderOutput

    return LatentsShapedOutput(output=DecoderOutput(sample=image), taken_from=taken_from)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _latents(args: tuple, kwargs: Mapping[str, Any]) -> tuple[str, torch.Tensor | None]:
    for keyword in _LATENT_KEYWORDS:
        value = kwargs.get(keyword)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return keyword, value
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return "its first argument", first
    return "", None


def _as_returned(prediction: torch.Tensor, kwargs: Mapping[str, Any]) -> Any:
    """`(prediction,)` for `return_dict=False` (what pipelines pass), else diffusers' output with a `sample`."""
    if kwargs.get("return_dict", True) is False:
        return (prediction,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=prediction)


def _described(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
