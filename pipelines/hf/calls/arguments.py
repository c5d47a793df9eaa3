"""The keyword arguments a capture passes to a diffusers pipeline's `__call__`: what `call=` gives, as the pipeline
takes it, and nothing of the user's that the capture could use up or change. Inputs the call leaves out stay the
pipeline's defaults; a blank stand-in fills an image input only where the call gives its size or the pipeline
cannot run without it (`with_stand_ins`). Without `call=`, the pipeline's default call at a small image size."""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Mapping

import numpy as np
import torch
from PIL import Image

from ...errors import CallSpecError

OUR_KEYS = ("batch_size",)
# One spelling for every pipeline: a video pipeline's `num_videos_per_prompt` taken as `num_images_per_prompt` too.
ALIASES = {"num_images_per_prompt": "num_videos_per_prompt"}
# The prompt planned for when call= gives none: long enough that every tokenizer truncates it at the pipeline's
# maximum sequence length, so pipelines that drop padding tokens (Qwen-Image, Z-Image) plan for their longest
# text, as those that pad to the maximum do.
DEFAULT_PROMPT = " ".join(["a lighthouse on a rocky coast at dusk, waves, gulls, warm light,"] * 64)
# Image inputs a call may give by their size alone, or leave out: an img2img, inpaint, ControlNet or image-to-video
# pipeline cannot run without one, and then gets a blank one of the call's size (only sizes matter). Where the
# pipeline runs without it (FLUX.2 klein's text-to-image, Wan VACE's unconditioned video), it is left out: a stand-in
# would plan another call (an image edit, twice the transformer's tokens).
STAND_IN_INPUTS = ("image", "mask_image", "control_image", "video", "mask")
# Of those, the ones a video pipeline takes as a list of frames (Wan VACE's `video` and `mask`).
VIDEO_INPUTS = ("video", "mask")
# Callables a pipeline calls during its loop: a capture is no run of the user's, so they are not called.
CALLBACK_KEYS = ("callback_on_step_end", "callback")
# Without call=, the pipeline's default call at this side (or the largest divisor of its default sizes up to it):
# only the runs per call are learned then, which the image size does not change, and a capture at full size costs
# a video pipeline a minute of CPU work on its own latents.
SMALL_SIDE = 64


def call_parameters(pipeline_class: type) -> dict[str, inspect.Parameter]:
    """The named keyword parameters of the class's `__call__`."""
    return {name: parameter for name, parameter in inspect.signature(pipeline_class.__call__).parameters.items()
            if name != "self" and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                         inspect.Parameter.VAR_KEYWORD)}


def call_arguments(pipeline_class: type, call: Mapping[str, Any], *, with_stand_ins: bool = False) -> dict[str, Any]:
    """The keyword arguments of the `__call__` that `call` describes: a blank stand-in for each image input it gives
    as a size or leaves out where the signature requires it (ChronoEdit's `image`); `with_stand_ins`: for every image
    input it leaves out (for a pipeline that fails without them)."""
    parameters = call_parameters(pipeline_class)
    name = pipeline_class.__name__
    call = {ALIASES[key] if key not in parameters and ALIASES.get(key) in parameters else key: value
            for key, value in call.items()}
    _check_keys(name, call, parameters)
    arguments = {key: value for key, value in call.items() if key in parameters}
    batch = call.get("batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CallSpecError(f"call= for {name}: batch_size must be a positive int (the number of prompts), got "
                            f"{batch!r}.")
    if "prompt" in parameters and arguments.get("prompt") is None and "prompt_embeds" not in arguments:
        arguments["prompt"] = DEFAULT_PROMPT if batch == 1 else [DEFAULT_PROMPT] * batch
    elif batch != 1 and isinstance(arguments.get("prompt"), str):
        arguments["prompt"] = [arguments["prompt"]] * batch
    if "output_type" in parameters and "output_type" not in call:
        arguments["output_type"] = "pt"  # tensors out: no conversion to PIL images of a blank result
    for key in STAND_IN_INPUTS:
        if key in parameters:
            value = arguments.get(key)
            required = parameters[key].default is inspect.Parameter.empty
            if _is_size(value) or (value is None and (with_stand_ins or required)):
                arguments[key] = _stand_in(name, key, value, call, parameters)
    return arguments


def missing_inputs(pipeline_class: type, arguments: Mapping[str, Any]) -> list[str]:
    """The image inputs the class takes that `arguments` leave out (what `with_stand_ins` would fill)."""
    parameters = call_parameters(pipeline_class)
    return [key for key in STAND_IN_INPUTS if key in parameters and arguments.get(key) is None]


def _check_keys(name: str, call: Mapping[str, Any], parameters: Mapping[str, inspect.Parameter]) -> None:
    sizes_images = any(key in parameters for key in STAND_IN_INPUTS)
    known = set(parameters) | set(OUR_KEYS) | ({"height", "width", "num_frames"} if sizes_images else set())
    unknown = [key for key in call if key not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CallSpecError(
            f"call= for {name}: unknown keyword {key!r}{hint}; call= takes what {name}.__call__ takes "
            f"({', '.join(sorted(parameters))}), and batch_size, vae_tiling, vae_slicing."
        )


def _is_size(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _stand_in(name: str, key: str, value: Any, call: Mapping[str, Any],
              parameters: Mapping[str, inspect.Parameter]) -> Any:
    """A blank input of the size `value` gives, else of the call's height and width (and frames for a video)."""
    video = key in VIDEO_INPUTS and "num_frames" in parameters
    if value is None:
        missing = [size for size in ("height", "width") if not isinstance(call.get(size), int)]
        if missing:
            raise CallSpecError(
                f"call= for {name} needs {' and '.join(missing)} to plan for its {key!r} input (or give it: "
                f"{key}=({'frames, ' if video else ''}height, width) or the real {'frames' if video else 'image'})."
            )
        frames = call.get("num_frames", parameters.get("num_frames") and parameters["num_frames"].default)
        value = (frames, call["height"], call["width"]) if video else (call["height"], call["width"])
    if len(value) != (3 if video else 2) or min(value) < 1:
        raise CallSpecError(f"call= for {name}: {key}={value!r} is not a size; give "
                            f"({'frames, ' if video else ''}height, width) in pixels.")
    mode = "L" if "mask" in key else "RGB"
    if video:
        frames, height, width = value
        return [Image.new(mode, (width, height)) for _ in range(frames)]
    height, width = value
    return Image.new(mode, (width, height))


def detached(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """`arguments` with nothing of the user's the capture could use up or change: generators replaced by copies
    of their state (the user's is not advanced), callbacks left out (not called), tensors and arrays by blank ones
    of their shapes (read, not used or written; integer ones, ids and masks, by copies: their values size
    things), lists and dicts of them likewise."""
    return {key: None if key in CALLBACK_KEYS else _detached(value) for key, value in arguments.items()}


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Generator):
        copy = torch.Generator(device=value.device)
        copy.set_state(value.get_state())
        return copy
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            return torch.zeros(value.shape, dtype=value.dtype, device="cpu")
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):
        return np.zeros_like(value) if value.dtype.kind in "fc" else value.copy()
    if isinstance(value, Image.Image):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    return value


def default_sizes(pipe: Any) -> dict[str, int]:
    """The height, width and frames the pipeline's call makes when not given: its `__call__`'s defaults, else
    diffusers' `default_sample_size * vae_scale_factor` (what most image pipelines compute); those it has."""
    parameters = call_parameters(type(pipe))
    sizes = {key: parameters[key].default for key in ("height", "width", "num_frames")
             if key in parameters and _is_count(parameters[key].default)}
    sample, factor = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if _is_count(sample) and _is_count(factor):
        for key in ("height", "width"):
            sizes.setdefault(key, sample * factor)
    return sizes


def small_default_call(pipe: Any) -> dict[str, Any]:
    """The call planned without `call=`: the pipeline's own defaults (steps, guidance, strength, frames), its image
    SMALL_SIDE pixels a side (a divisor of its default sizes where it has them, so that its multiple-of checks
    pass); {} for a pipeline that takes no size."""
    parameters = call_parameters(type(pipe))
    if not ({"height", "width"} <= set(parameters) or any(key in parameters for key in STAND_IN_INPUTS)):
        return {}
    defaults = default_sizes(pipe)
    side = math.gcd(defaults.get("height", 0), defaults.get("width", 0), SMALL_SIDE)
    return {"height": side, "width": side}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def recorded_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """`call` as a plan records it (JSON): an image as [height, width], frames as [frames, height, width], a tensor
    as its shape; numbers, strings and their lists as they are; anything else by its repr."""
    return {key: _recorded(value) for key, value in call.items()}


def _recorded(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Image.Image):
        return [value.height, value.width]
    shape = getattr(value, "shape", None)
    if shape is not None:
        return list(shape)
    if isinstance(value, (list, tuple)):
        items = [_recorded(item) for item in value]
        if items and all(isinstance(item, list) and len(item) == 2 and isinstance(value[0], Image.Image)
                         for item in items):
            return [len(items), *items[0]]  # frames of one size
        return items
    if isinstance(value, Mapping):
        return {str(key): _recorded(item) for key, item in value.items()}
    return repr(value)
