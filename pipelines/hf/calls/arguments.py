"""The arguments of the call `call=` describes, checked against the pipeline's own `__call__` signature.

`call=` takes any keyword the pipeline's `__call__` accepts (`height`, `num_inference_steps`, `negative_prompt`,
`true_cfg_scale`, `strength`, an `image` ...), plus three of this library's: `batch_size` (the number of prompts),
and `vae_tiling` / `vae_slicing` (handled before this, `memory_techniques.VaeOptions`); `num_images_per_prompt`
is a video pipeline's `num_videos_per_prompt` too. An unknown keyword is
named with the closest one the signature has. Inputs the call needs but `call=` may leave out (an img2img
pipeline's `image`, an inpaint's `mask_image`) are made blank at the call's size (`overrides.STAND_IN_INPUTS`);
they may also be given as sizes: `image=(height, width)`, `video=(frames, height, width)`, or as the real objects.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Mapping

from PIL import Image

from ...errors import CallSpecError
from .overrides import STAND_IN_INPUTS, VIDEO_INPUTS

OUR_KEYS = ("batch_size",)
# One spelling for every pipeline: a video pipeline's `num_videos_per_prompt` taken as `num_images_per_prompt` too.
ALIASES = {"num_images_per_prompt": "num_videos_per_prompt"}
# The prompt planned for when call= gives none: long enough that every tokenizer truncates it at the pipeline's
# maximum sequence length, so pipelines that drop padding tokens (Qwen-Image, Z-Image) plan for their longest
# text, as those that pad to the maximum do.
DEFAULT_PROMPT = " ".join(["a lighthouse on a rocky coast at dusk, waves, gulls, warm light,"] * 64)


def call_parameters(pipeline_class: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters of the pipeline's `__call__` (its signature, `self` left out)."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return {name: parameter for name, parameter in parameters.items() if name != "self"
            and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def call_arguments(pipeline_class: type, call: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the `__call__` that `call` describes (module doc)."""
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
            if value is None or _is_size(value):
                arguments[key] = _stand_in(name, key, value, call, parameters)
    return arguments


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


def recorded_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """`call` as a plan records it (JSON): an image as [height, width], a list of frames as [frames, height,
    width], a tensor or array as its shape; numbers, strings and their lists as they are; anything else by its
    repr."""
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
