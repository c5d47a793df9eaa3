"""The host memory a capture takes. The components stand in on fake tensors, but the pipeline's own code runs for
real on the CPU: its latents, the prompt embeddings it repeats per image, and the blank outputs the stand-ins answer
with (a decoded image per image asked) are real tensors. A call that cannot fit the host is refused before any work
(`check_host_room`, from the call's numbers and the pipeline's defaults), and any answer that would take the process
past the room it had when the capture began is refused before it is allocated (`HostRoom`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import psutil
from torch import nn

from placement.sizes import format_bytes

from ...errors import CallSpecError
from .arguments import STAND_IN_INPUTS, call_parameters, default_sizes

# The fewest bytes of an element the pipeline holds: bf16/fp16 outputs (float32 ones take twice as much).
_FEWEST_BYTES = 2
_CHANNELS = 3
# Of the memory available when a capture begins, the share it may take: the rest is the machine's (other
# processes, the allocator's slack).
_SHARE = 0.8
# Answers smaller than this are not weighed (nor the process's size read for them).
_SMALL_ANSWER = 1 << 20
# A tokenizer's `model_max_length` above this is transformers' "no limit" (1e30), not a length.
_LONGEST_TOKENIZER = 1 << 20


def available_host_bytes() -> int:
    return psutil.virtual_memory().available


def check_host_room(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any]) -> None:
    """A `CallSpecError` naming the numbers when the tensors the call makes on the host (decoded images, prompt
    embeddings, one per image) take more than the memory available, before anything is run."""
    room = int(available_host_bytes() * _SHARE)
    copies = _copies(pipe, call)
    needs = [need for need in (_decoded(pipe, call, copies), _embedded(pipe, modules, call, copies)) if need]
    total = sum(size for size, _ in needs)
    if total > room:
        parts = "; ".join(what for _, what in needs)
        raise CallSpecError(
            f"call= for {type(pipe).__name__} makes at least {format_bytes(total)} of tensors on this machine's "
            f"memory while it is planned ({parts}), more than the {format_bytes(room)} it may take "
            f"({_SHARE:.0%} of the {format_bytes(int(room / _SHARE))} available). Nothing was run: plan for fewer "
            "images per call (batch_size, num_images_per_prompt) or a smaller size, and run larger batches as "
            "several calls."
        )


def _copies(pipe: Any, call: Mapping[str, Any]) -> int:
    parameters = call_parameters(type(pipe))
    per_prompt = next((call[key] for key in ("num_images_per_prompt", "num_videos_per_prompt") if key in call),
                      next((parameters[key].default for key in ("num_images_per_prompt", "num_videos_per_prompt")
                            if key in parameters), 1))
    prompts = call.get("batch_size", 1)
    return _count(prompts) * _count(per_prompt)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _decoded(pipe: Any, call: Mapping[str, Any], copies: int) -> tuple[int, str] | None:
    sizes = {**default_sizes(pipe), **_image_size(call), **{key: call[key] for key in ("height", "width", "num_frames")
                                                             if isinstance(call.get(key), int)}}
    if "height" not in sizes or "width" not in sizes:
        return None
    frames = _count(sizes.get("num_frames", 1))
    pixels = sizes["height"] * sizes["width"] * frames * copies
    return (pixels * _CHANNELS * _FEWEST_BYTES,
            f"the decoded output, {copies:,} x {frames} frame(s) of {sizes['height']}x{sizes['width']} pixels x "
            f"{_CHANNELS} channels x {_FEWEST_BYTES} bytes")


def _image_size(call: Mapping[str, Any]) -> dict[str, int]:
    """The height and width of the image the call gives (a size, a PIL image, an array or a tensor), where the
    pipeline takes its output's size from it (img2img)."""
    for key in STAND_IN_INPUTS:
        value = call.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(side, int) for side in value):
            height, width = value[-2:]
        elif isinstance(getattr(value, "size", None), tuple):  # PIL: (width, height)
            width, height = value.size
        elif len(getattr(value, "shape", ())) >= 2:
            height, width = (value.shape[-3:-1] if isinstance(value, np.ndarray) else value.shape[-2:])
        else:
            continue
        return {"height": int(height), "width": int(width)}
    return {}


def _embedded(pipe: Any, modules: Mapping[str, nn.Module], call: Mapping[str, Any],
              copies: int) -> tuple[int, str] | None:
    """The widest text encoder's output for each image: its hidden size x the call's token count."""
    parameters = call_parameters(type(pipe))
    tokens = call.get("max_sequence_length", getattr(parameters.get("max_sequence_length"), "default", None))
    if not isinstance(tokens, int):  # CLIP's pipelines pad to the tokenizer's length
        tokens = getattr(getattr(pipe, "tokenizer", None), "model_max_length", None)
        tokens = tokens if isinstance(tokens, int) and tokens <= _LONGEST_TOKENIZER else None
    widths = [width for name, module in modules.items() if name.startswith("text_encoder")
              for width in [_hidden_size(module)] if width]
    if not widths or not isinstance(tokens, int) or tokens < 1:
        return None
    width = max(widths)
    return (copies * tokens * width * _FEWEST_BYTES,
            f"prompt embeddings, {copies:,} x {tokens} tokens x {width} x {_FEWEST_BYTES} bytes")


def _hidden_size(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    config = getattr(config, "text_config", None) or config
    for key in ("hidden_size", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(kw_only=True)
class HostRoom:
    """The room a capture had when it began; `check(bytes, what)` refuses an allocation that would go past it."""

    pipeline: str
    start: int  # the process's resident bytes when the capture began
    room: int

    @classmethod
    def now(cls, pipeline: str) -> "HostRoom":
        return cls(pipeline=pipeline, start=psutil.Process().memory_info().rss,
                   room=int(available_host_bytes() * _SHARE))

    def check(self, size: int, what: str) -> None:
        if size < _SMALL_ANSWER:
            return  # a small answer fills no host; the large ones that follow are weighed with all grown before them
        grown = max(psutil.Process().memory_info().rss - self.start, 0)
        if grown + size > self.room:
            raise CallSpecError(
                f"call= for {self.pipeline}: planning it would hold {format_bytes(grown + size)} on this machine "
                f"({what} needs {format_bytes(size)}, after {format_bytes(grown)} the pipeline's own tensors took), "
                f"more than the {format_bytes(self.room)} it may take ({_SHARE:.0%} of the memory available when "
                "planning began). Nothing more was allocated: plan for fewer images per call (batch_size, "
                "num_images_per_prompt) or a smaller size."
            )

