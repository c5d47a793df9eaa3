"""Text and image encoder calls as the diffusers pipelines make them.

Each encoder sees the prompts once (the negative prompts in a second call of the same size, so the peak is that
of one), padded to the pipeline's fixed length. LLM-style encoders (Llama, Gemma2, Qwen2.5-VL) are called
with their KV cache left on, as the pipelines call them; the estimator runs that cache on fake tensors
(`placement.activations.stand_ins`).
"""

from __future__ import annotations

from torch import nn

from .shapes import config_value, floats, tokens
from .spec import ExampleCall


def text_call(encoder: nn.Module, batch: int, length: int, *, mask: bool = False, hidden_states: bool = False,
              **extra) -> ExampleCall:
    """`encoder(ids, attention_mask=..., output_hidden_states=...)` on `batch` prompts of `length` tokens."""
    kwargs = dict(extra)
    if mask:
        kwargs["attention_mask"] = tokens(batch, length)
    if hidden_states:
        kwargs["output_hidden_states"] = True
    return ExampleCall(args=(tokens(batch, length),), kwargs=kwargs)


def clip_length(encoder: nn.Module, wanted: int = 77) -> int:
    """CLIP tokenizers pad to 77 (the encoder's position table); never beyond the table."""
    return min(wanted, config_value(encoder, "max_position_embeddings", default=wanted))


def clip_vision_call(encoder: nn.Module, batch: int) -> ExampleCall:
    """`image_encoder(pixel_values, output_hidden_states=True)` on one preprocessed image per prompt."""
    side = config_value(encoder, "image_size", default=224)
    channels = config_value(encoder, "num_channels", default=3)
    return ExampleCall(args=(floats(encoder, batch, channels, side, side),), kwargs={"output_hidden_states": True})


def present(modules, *names: str) -> list[tuple[str, nn.Module]]:
    """(name, module) for each of `names` that the pipeline has (optional components may be None or absent)."""
    return [(name, modules[name]) for name in names if isinstance(modules.get(name), nn.Module)]
