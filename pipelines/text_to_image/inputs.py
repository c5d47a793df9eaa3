"""What one TextToImagePipeline call feeds each component: example inputs on meta, for activation estimates.

`text_to_image_activation_inputs` is bound as `TextToImagePipeline.activation_inputs`. It mirrors
`TextToImagePipeline.__call__` shape for shape, so the estimate is of the call the user will make:
- each text encoder sees every prompt text — the negative ones too under classifier-free guidance — padded
  to the tokenizer's max length (the encoder's `max_position_embeddings`), with an attention mask;
- the denoiser sees the latents (height / f, width / f, f the VAE's downsampling factor), a 0-d timestep, the
  combined text sequence and the pooled embedding (`pipe.text_conditioning` decides which, as in the call);
  guidance_scale > 1 doubles its batch (unconditional + conditional in one pass);
- the VAE runs `decode` on one latent per image.
Floating inputs have the dtype of the component's weights; `estimate_activations(dtype=...)` recasts both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from placement import estimate_activations
from ..errors import LoadError

from .models import TextEncoderOutput
from ..framework.pipeline import module_dtype

_META = torch.device("meta")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


@dataclass(frozen=True, kw_only=True)
class ComponentCall:
    """One component's part of a pipeline call: `getattr(module, method)(*args, **kwargs)`, tensors on meta."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    method: str = "forward"

    def estimate(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> int:
        """Peak activation bytes of this call on `module` (see `placement.estimate_activations`)."""
        return estimate_activations(module, self.args, self.kwargs, method=self.method, dtype=dtype)


def text_to_image_activation_inputs(
    pipe,
    height: int,
    width: int,
    batch_size: int = 1,
    num_images_per_prompt: int = 1,
    guidance_scale: float = 4.0,
) -> dict[str, ComponentCall]:
    """Per module component, the inputs `pipe(prompt, height=..., width=..., ...)` gives it, on meta.

    `batch_size` is the number of prompts. The defaults match `TextToImagePipeline.__call__`'s.
    """
    _check_spec(pipe, height, width, batch_size, num_images_per_prompt)
    images = batch_size * num_images_per_prompt
    guided_batch = images * (2 if guidance_scale > 1.0 else 1)  # CFG: negatives + prompts in one batch

    calls: dict[str, ComponentCall] = {}
    encoder_outputs = []
    for name in TEXT_ENCODERS:
        encoder = getattr(pipe, name, None)
        if encoder is None:
            continue
        calls[name] = _text_encoder_call(encoder, guided_batch)
        encoder_outputs.append(_text_encoder_output(encoder, guided_batch))
    # The pipeline's own rule combines the encoders' outputs, so the shapes cannot drift from the real call.
    sequence, pooled = pipe.text_conditioning.combine(encoder_outputs, _META)

    factor = pipe.vae_scale_factor
    latent_side = (height // factor, width // factor)
    calls["denoiser"] = _denoiser_call(pipe.denoiser, guided_batch, latent_side, sequence, pooled)
    vae_latents = torch.empty(
        (images, pipe.vae.config.latent_channels, *latent_side), dtype=module_dtype(pipe.vae), device=_META
    )
    calls["vae"] = ComponentCall(args=(vae_latents,), method="decode")
    return calls


def text_to_image_runs_per_call(pipe, num_inference_steps: int = 20, strength: float | None = None,
                                **sizes) -> dict[str, int]:
    """Runs per call of each component (bound as `TextToImagePipeline.runs_per_call`): the denoiser once per
    step (guidance doubles its batch, not its passes), the others once. Defaults as `__call__`'s."""
    if strength is not None:  # a run key, so activation_inputs never sees it: refused here, not ignored
        raise LoadError(
            f"strength={strength!r}: {type(pipe).__name__} does not start from an image; leave strength out.")
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise LoadError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}.")
    return {"denoiser": num_inference_steps}


def _text_encoder_call(encoder, batch: int) -> ComponentCall:
    length = encoder.config.max_position_embeddings
    tokens = torch.empty((batch, length), dtype=torch.long, device=_META)
    mask = torch.empty((batch, length), dtype=torch.long, device=_META)
    return ComponentCall(args=(tokens,), kwargs={"attention_mask": mask})


def _text_encoder_output(encoder, batch: int) -> TextEncoderOutput:
    config, dtype = encoder.config, module_dtype(encoder)
    hidden = torch.empty((batch, config.max_position_embeddings, config.hidden_size), dtype=dtype, device=_META)
    pooled = torch.empty((batch, config.pooled_dim), dtype=dtype, device=_META)
    return TextEncoderOutput(last_hidden_state=hidden, pooled_output=pooled)


def _denoiser_call(denoiser, batch: int, latent_side: tuple[int, int], sequence, pooled) -> ComponentCall:
    dtype = module_dtype(denoiser)
    latents = torch.empty((batch, denoiser.config.in_channels, *latent_side), dtype=dtype, device=_META)
    timestep = torch.empty((), dtype=torch.float32, device=_META)  # one scheduler timestep, a 0-d tensor
    kwargs = {} if pooled is None else {"pooled": pooled.to(dtype)}
    return ComponentCall(args=(latents, timestep, sequence.to(dtype)), kwargs=kwargs)


def _check_spec(pipe, height: int, width: int, batch_size: int, num_images_per_prompt: int) -> None:
    for name, value in (("batch_size", batch_size), ("num_images_per_prompt", num_images_per_prompt)):
        if not isinstance(value, int) or value < 1:
            raise LoadError(f"activation_inputs: {name} must be a positive int, got {value!r}.")
    multiple = pipe.image_size_multiple
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            nearest = max(multiple, round(value / multiple) * multiple) if isinstance(value, (int, float)) else 1024
            raise LoadError(
                f"activation_inputs: {name}={value!r} must be a positive multiple of {multiple} (the VAE's "
                f"downsampling factor {pipe.vae_scale_factor} times the {type(pipe.denoiser).__name__}'s "
                f"{multiple // pipe.vae_scale_factor}); try {nearest}."
            )
