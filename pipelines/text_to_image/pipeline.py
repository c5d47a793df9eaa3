"""TextToImagePipeline: text encoder(s) -> denoiser (UNet or DiT) -> VAE, flow matching with classifier-free guidance.

The pipeline never moves weights: it hands each component its inputs on that component's execution device.
How encoders feed the denoiser follows from their widths (SDXL concatenates two; Flux attends to the second
and pools the first), so no per-pipeline flag can disagree with the models. `activation_inputs` mirrors
`__call__` shape for shape on meta, using the same `text_conditioning`, so the plan is of the real call."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import numpy as np
import torch

from placement import estimate_activations

from ..errors import CallError, LoadError
from ..folder.class_registry import library_class
from ..framework.pipeline import Pipeline, module_dtype
from .models import TextEncoderOutput


class SequenceSource(str, Enum):
    FIRST = "first"  # text_encoder's hidden states
    SECOND = "second"  # text_encoder_2's hidden states
    CONCAT = "concat"  # both, concatenated along the feature axis


@dataclass(frozen=True, kw_only=True)
class TextConditioning:
    sequence: SequenceSource
    pooled_from: int | None  # index of the encoder giving the pooled embedding; None: the denoiser takes none

    def combine(self, outputs: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        states = [output.last_hidden_state.to(device) for output in outputs]
        if self.sequence is SequenceSource.CONCAT:
            sequence = torch.cat(states, dim=-1)
        else:
            sequence = states[0 if self.sequence is SequenceSource.FIRST else 1]
        pooled = None if self.pooled_from is None else outputs[self.pooled_from].pooled_output.to(device)
        return sequence, pooled


def denoiser_text_widths(denoiser) -> tuple[int, int | None]:
    """(width of encoder_hidden_states, width of pooled or None) the denoiser's config asks for."""
    config = denoiser.config
    width = getattr(config, "cross_attention_dim", None) or getattr(config, "joint_attention_dim", None)
    if width is None:
        raise CallError(
            f"{type(denoiser).__name__}.config has neither cross_attention_dim nor joint_attention_dim, so the "
            "pipeline cannot tell how wide its text conditioning is."
        )
    return width, getattr(config, "pooled_projection_dim", None)


def text_conditioning_for(encoders: list, denoiser) -> TextConditioning:
    """Match the encoders' hidden/pooled widths to the denoiser's."""
    width, pooled_width = denoiser_text_widths(denoiser)
    hidden = [encoder.config.hidden_size for encoder in encoders]
    pooled = [encoder.config.pooled_dim for encoder in encoders]
    if len(encoders) == 1 and hidden[0] == width:
        sequence = SequenceSource.FIRST
    elif len(encoders) == 2 and sum(hidden) == width:
        sequence = SequenceSource.CONCAT
    elif len(encoders) == 2 and hidden[1] == width:
        sequence = SequenceSource.SECOND
    else:
        raise CallError(
            f"The text encoders' hidden sizes {hidden} do not fit {type(denoiser).__name__}'s text width {width}: "
            "one encoder must match it, or two encoders must sum to it (SDXL) or the second must match (Flux)."
        )
    if pooled_width is None:
        return TextConditioning(sequence=sequence, pooled_from=None)
    # Prefer the last encoder (SDXL's convention); Flux's pooled CLIP is the only match anyway.
    for index in reversed(range(len(encoders))):
        if pooled[index] == pooled_width:
            return TextConditioning(sequence=sequence, pooled_from=index)
    raise CallError(
        f"{type(denoiser).__name__} needs a pooled text embedding of width {pooled_width}, but the encoders' pooled "
        f"widths are {pooled}; configure an encoder's projection_dim to {pooled_width}."
    )


_META = torch.device("meta")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


@dataclass(frozen=True, kw_only=True)
class ComponentCall:
    """One component's part of a pipeline call: `getattr(module, method)(*args, **kwargs)`, tensors on meta."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    method: str = "forward"

    def estimate(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> int:
        return estimate_activations(module, self.args, self.kwargs, method=self.method, dtype=dtype)


def text_to_image_activation_inputs(pipe, height: int, width: int, batch_size: int = 1, num_images_per_prompt: int = 1,
                                    guidance_scale: float = 4.0) -> dict[str, ComponentCall]:
    """Per module component, the inputs `pipe(prompt, ...)` gives it, on meta; defaults as `__call__`'s."""
    _check_spec(pipe, height, width, batch_size, num_images_per_prompt)
    images = batch_size * num_images_per_prompt
    guided_batch = images * (2 if guidance_scale > 1.0 else 1)

    calls: dict[str, ComponentCall] = {}
    encoder_outputs = []
    for name in TEXT_ENCODERS:
        encoder = getattr(pipe, name, None)
        if encoder is None:
            continue
        calls[name] = _text_encoder_call(encoder, guided_batch)
        encoder_outputs.append(_text_encoder_output(encoder, guided_batch))
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
    """The denoiser runs once per step (guidance doubles its batch, not its passes), the others once."""
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


class OutputType(str, Enum):
    PIL = "pil"
    NP = "np"
    PT = "pt"


@dataclass(frozen=True, kw_only=True)
class TextToImageOutput:
    """`images`: a list of PIL images, a (B, H, W, 3) float numpy array in [0, 1], or a (B, 3, H, W) tensor."""

    images: Any


@library_class
class TextToImagePipeline(Pipeline):
    """The reference text-to-image pipeline; `text_encoder_2` is optional."""

    model_graph = [("text_encoder", "denoiser"), ("text_encoder_2", "denoiser"), ("denoiser", "vae")]
    activation_inputs = text_to_image_activation_inputs
    runs_per_call = text_to_image_runs_per_call

    def __init__(self, text_encoder, denoiser, vae, scheduler, tokenizer, text_encoder_2=None):
        super().__init__()
        self.register_components(text_encoder=text_encoder, text_encoder_2=text_encoder_2, denoiser=denoiser,
                                 vae=vae, scheduler=scheduler, tokenizer=tokenizer)

    @classmethod
    def from_preset(cls, name: str, *, device: str = "cpu", seed: int = 0) -> "TextToImagePipeline":
        """A preset's pipeline: random weights from `seed` on "cpu", or built on "meta" for planning."""
        from .presets import build_preset_components

        return cls(**build_preset_components(name, device=device, seed=seed))

    @property
    def text_encoders(self) -> list:
        return [encoder for encoder in (self.text_encoder, self.text_encoder_2) if encoder is not None]

    @property
    def text_conditioning(self) -> TextConditioning:
        return text_conditioning_for(self.text_encoders, self.denoiser)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae.downsampling_factor)

    @property
    def image_size_multiple(self) -> int:
        """The VAE's factor times the denoiser's (a UNet's downsampling factor, a DiT's patch size)."""
        denoiser = self.denoiser
        return self.vae_scale_factor * getattr(denoiser, "downsampling_factor",
                                               getattr(denoiser.config, "patch_size", 1))

    @torch.inference_mode()
    def __call__(self, prompt: str | list[str], *, negative_prompt: str | list[str] | None = None,
                 height: int = 512, width: int = 512, num_inference_steps: int = 20, guidance_scale: float = 4.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None, output_type: OutputType | str = "pil") -> TextToImageOutput:
        output_type = _output_type(output_type)
        if not isinstance(prompt, (str, list, tuple)):
            raise CallError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}.")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        _check_numbers(height=height, width=width, num_inference_steps=num_inference_steps,
                       num_images_per_prompt=num_images_per_prompt, guidance_scale=guidance_scale)
        self._check_call(prompts, height, width, num_inference_steps, num_images_per_prompt)
        guided = guidance_scale > 1.0
        negatives = _negative_prompts(negative_prompt, len(prompts)) if guided else []
        texts = [text for text in negatives + prompts for _ in range(num_images_per_prompt)]
        batch = len(prompts) * num_images_per_prompt
        try:
            sequence, pooled = self.encode_text(texts)
            latents = self.prepare_latents(batch, height, width, generator=generator, latents=latents)
            latents = self.denoise(latents, sequence, pooled, num_inference_steps, guidance_scale if guided else None)
            images = self.decode(latents, output_type)
        finally:
            # Model offload keeps the VAE on the accelerator: freed between calls, also after a failed one.
            self.maybe_free_model_hooks()
        return TextToImageOutput(images=images)

    def encode_text(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        outputs = []
        for name, encoder in (("text_encoder", self.text_encoder), ("text_encoder_2", self.text_encoder_2)):
            if encoder is None:
                continue
            tokens = self.tokenizer(texts, max_length=encoder.config.max_position_embeddings)
            device = self.component_execution_device(name)
            outputs.append(encoder(tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)))
        return self.text_conditioning.combine(outputs, self.component_execution_device("denoiser"))

    def prepare_latents(self, batch: int, height: int, width: int, *, generator: torch.Generator | None,
                        latents: torch.Tensor | None) -> torch.Tensor:
        """Noise drawn on the generator's device (CPU by default: the same noise on every machine)."""
        factor = self.vae_scale_factor
        shape = (batch, self.denoiser.config.in_channels, height // factor, width // factor)
        if latents is None:
            noise_device = generator.device if generator is not None else torch.device("cpu")
            latents = torch.randn(shape, generator=generator, device=noise_device, dtype=torch.float32)
        elif tuple(latents.shape) != shape:
            raise CallError(f"latents have shape {tuple(latents.shape)}; this call needs {shape}.")
        return latents.to(self.component_execution_device("denoiser"), module_dtype(self.denoiser))

    def denoise(self, latents: torch.Tensor, sequence: torch.Tensor, pooled: torch.Tensor | None, steps: int,
                guidance_scale: float | None) -> torch.Tensor:
        self.scheduler.set_timesteps(steps)
        dtype = module_dtype(self.denoiser)
        sequence = sequence.to(dtype)
        pooled = pooled.to(dtype) if pooled is not None else None
        extra = {} if pooled is None else {"pooled": pooled}
        for timestep in self.progress_bar(self.scheduler.timesteps):
            model_input = torch.cat([latents, latents]) if guidance_scale is not None else latents
            prediction = self.denoiser(model_input, timestep, sequence, **extra)
            if guidance_scale is not None:
                unconditional, conditional = prediction.chunk(2)
                prediction = unconditional + guidance_scale * (conditional - unconditional)
            latents = self.scheduler.step(prediction, timestep, latents)
        return latents

    def decode(self, latents: torch.Tensor, output_type: OutputType):
        config = self.vae.config
        latents = latents / config.scaling_factor + getattr(config, "shift_factor", 0.0)
        vae_device = self.component_execution_device("vae")
        images = self.vae.decode(latents.to(vae_device, module_dtype(self.vae)))
        images = (images.float() / 2 + 0.5).clamp(0, 1)
        if output_type is OutputType.PT:
            return images
        array = images.permute(0, 2, 3, 1).cpu().numpy()
        if output_type is OutputType.NP:
            return array
        from PIL import Image

        return [Image.fromarray((image * 255).round().astype(np.uint8)) for image in array]

    def _check_call(self, prompts: list[str], height: int, width: int, steps: int, per_prompt: int) -> None:
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise CallError(f"prompt must be a string or a non-empty list of strings, got {prompts!r}.")
        multiple = self.image_size_multiple
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise CallError(
                f"height={height} and width={width} must be positive multiples of {multiple} (the VAE's factor "
                f"{self.vae_scale_factor} times the denoiser's); try {max(multiple, height // multiple * multiple)}."
            )
        if steps < 1 or per_prompt < 1:
            raise CallError(
                f"num_inference_steps ({steps}) and num_images_per_prompt ({per_prompt}) must be at least 1."
            )


def _check_numbers(*, guidance_scale, **integers) -> None:
    """Ints and a finite guidance_scale: a NaN scale shows only as black images, a string as a deep TypeError."""
    for name, value in integers.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise CallError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) \
            or not math.isfinite(guidance_scale):
        raise CallError(
            f"guidance_scale must be a finite number (e.g. 4.0; 1.0 or less turns guidance off), got {guidance_scale!r}."
        )


def _output_type(value: OutputType | str) -> OutputType:
    try:
        return OutputType(value)
    except ValueError:
        supported = ", ".join(repr(kind.value) for kind in OutputType)
        raise CallError(f"output_type={value!r} is not supported; use one of {supported}.") from None


def _negative_prompts(negative_prompt: str | list[str] | None, count: int) -> list[str]:
    if negative_prompt is None:
        return [""] * count
    negatives = [negative_prompt] * count if isinstance(negative_prompt, str) else list(negative_prompt)
    if len(negatives) != count:
        raise CallError(f"{len(negatives)} negative prompts for {count} prompts; give one per prompt.")
    return negatives
