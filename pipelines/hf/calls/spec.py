"""What a `call=` asks for (`CallSpec`) and what one component runs for it (`ExampleCall`).

`CallSpec` is the call a user will make (`pipe(prompt, height=..., width=..., num_frames=..., ...)`), with the
family's own defaults filled in where the user gave none, so that an estimate is of the call diffusers runs by
default. `ExampleCall` is one method call of one component on meta tensors; a component may run several in a
call (the Wan I2V VAE encodes the conditioning video, then decodes), and its activation peak is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

from placement import estimate_call
from ...errors import LoadError

CALL_KEYS = ("height", "width", "num_frames", "batch_size", "num_images_per_prompt", "guidance_scale",
             "max_sequence_length", "num_inference_steps", "strength")
# Keys of `call=` that say how many times the denoiser runs, not what it runs on (`family_table.Family.runs`).
RUN_KEYS = ("num_inference_steps", "strength")
# Keys of `call=` that choose memory techniques rather than sizes (`pipelines.loading.memory_techniques`).
TECHNIQUE_KEYS = ("vae_tiling", "vae_slicing")


class CallSpecError(LoadError, ValueError):
    """A `call=` spec the pipeline cannot turn into example inputs."""


@dataclass(frozen=True, kw_only=True)
class ExampleCall:
    """One component's part of a pipeline call: `getattr(module, method)(*args, **kwargs)`, tensors on meta."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    method: str = "forward"
    keep_values: bool = False  # its integer inputs' values size tensors (`placement.estimate_call`)

    def estimate(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> int:
        """Peak activation bytes of this call on `module` (see `placement.estimate_call`)."""
        return estimate_call(module, self.args, dict(self.kwargs), method=self.method, dtype=dtype,
                             keep_values=self.keep_values).peak_bytes


@dataclass(frozen=True, kw_only=True)
class CallSpec:
    """A pipeline call's sizes. `batch_size` is the number of prompts; `images` what the VAE decodes."""

    height: int
    width: int
    num_frames: int | None = None
    batch_size: int = 1
    num_images_per_prompt: int = 1
    guidance_scale: float = 1.0
    max_sequence_length: int | None = None
    num_inference_steps: int | None = None  # the denoising steps (runs of the denoiser per pass)
    strength: float | None = None  # img2img/inpaint: the share of the steps run from the noised image

    @property
    def images(self) -> int:
        """Images (or videos) generated: one latent each."""
        return self.batch_size * self.num_images_per_prompt

    def denoiser_batch(self, *, cfg_doubles: bool) -> int:
        """The denoiser's batch: doubled when guidance > 1 and the pipeline batches negatives with prompts."""
        return self.images * (2 if cfg_doubles and self.guidance_scale > 1.0 else 1)

    @classmethod
    def parse(cls, call: Mapping[str, Any], *, pipeline: str, defaults: Mapping[str, Any]) -> "CallSpec":
        """`call` checked (known keys, positive ints) with `defaults` (the family's) for what it leaves out."""
        unknown = sorted(set(call) - set(CALL_KEYS))
        if unknown:
            raise CallSpecError(
                f"call= for {pipeline} has unknown key(s) {unknown}; it takes {', '.join(CALL_KEYS + TECHNIQUE_KEYS)}."
            )
        values = {**defaults, **{key: value for key, value in call.items() if value is not None}}
        for key in ("height", "width"):
            if key not in values:
                raise CallSpecError(f"call= for {pipeline} needs {key!r}, e.g. {{'height': 1024, 'width': 1024}}.")
        for key in ("height", "width", "num_frames", "batch_size", "num_images_per_prompt", "max_sequence_length",
                    "num_inference_steps"):
            value = values.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CallSpecError(f"call= for {pipeline}: {key} must be a positive int, got {value!r}.")
        guidance = values.get("guidance_scale", 1.0)
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)):
            raise CallSpecError(f"call= for {pipeline}: guidance_scale must be a number, got {guidance!r}.")
        strength = values.get("strength")
        if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))
                                     or not 0 < strength <= 1):
            raise CallSpecError(f"call= for {pipeline}: strength must be a number in (0, 1], got {strength!r}.")
        return cls(**{**values, "guidance_scale": float(guidance),
                      **({"strength": float(strength)} if strength is not None else {})})

    def checked_multiple(self, multiple: int, *, pipeline: str) -> "CallSpec":
        """Itself, after checking height and width are multiples of `multiple` (the latent grid's pixel step)."""
        for key in ("height", "width"):
            value = getattr(self, key)
            if value % multiple:
                nearest = max(multiple, round(value / multiple) * multiple)
                raise CallSpecError(
                    f"call= for {pipeline}: {key}={value} is not a multiple of {multiple} (its VAE's downsampling "
                    f"times its denoiser's patch size); the pipeline would resize or reject it. Try {nearest}."
                )
        return self

    def with_frames(self, num_frames: int) -> "CallSpec":
        return replace(self, num_frames=num_frames)
