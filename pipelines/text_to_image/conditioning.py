"""How one or two text encoders feed a denoiser, derived from their widths (no per-pipeline flag to get wrong).

- SDXL: the two encoders' hidden states are concatenated along the feature axis (768 + 1280 = the UNet's
  2048-wide cross-attention); the pooled embedding comes from the encoder whose pooled width matches.
- Flux: the second encoder (T5) alone is the sequence the DiT attends to (4096 wide); the pooled embedding
  comes from the first (CLIP, 768).
- One encoder: its hidden states and (if the denoiser takes one) its pooled output.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import CallError


class SequenceSource(str, Enum):
    FIRST = "first"  # text_encoder's hidden states
    SECOND = "second"  # text_encoder_2's hidden states
    CONCAT = "concat"  # both, concatenated along the feature axis


@dataclass(frozen=True, kw_only=True)
class TextConditioning:
    sequence: SequenceSource
    pooled_from: int | None  # index of the encoder giving the pooled embedding; None: the denoiser takes none

    def combine(self, outputs: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(encoder_hidden_states, pooled) on `device` from the encoders' outputs."""
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
    """Match the encoders' hidden/pooled widths to the denoiser's; a clear error when nothing matches."""
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
