"""The call a pipeline makes by default: its own size, steps and guidance, read from the class, not assumed.

`placement run` passes the pipeline only what the user gave, so the pipeline's defaults apply (FLUX: 1024x1024,
28 steps; SD 1.5: 512x512, 50 steps; ours: 512x512, 20 steps). To plan for that call and to size the progress
bar it needs the same numbers beforehand: the defaults of the class's `__call__` (ours, or the diffusers class
the folder names), and where a diffusers `__call__` says `height=None` ("the default sample size"), diffusers'
own rule: the denoiser config's `sample_size` times the VAE's downsampling, 2 ** (len(block_out_channels) - 1).
A number that cannot be found this way stays unknown (None): the plan is then made for weights only.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .targets import TargetPlanner

KEYS = ("height", "width", "num_inference_steps", "guidance_scale")
DENOISERS = ("transformer", "unet")


def default_call(folder: Path, pipeline_class: type) -> dict[str, Any]:
    """{height, width, num_inference_steps, guidance_scale} the pipeline in `folder` uses when not told; a key
    whose value cannot be found is left out."""
    runtime = _runtime_class(folder, pipeline_class)
    defaults = {} if runtime is None else class_defaults(runtime)
    if "height" not in defaults or "width" not in defaults:
        side = _default_sample_pixels(folder)
        if side is not None:
            defaults = {"height": side, "width": side, **defaults}
    return {key: defaults[key] for key in KEYS if key in defaults}


def class_defaults(runtime: type) -> dict[str, Any]:
    """The numbers among KEYS that `runtime.__call__` gives as its defaults."""
    parameters = inspect.signature(runtime.__call__).parameters
    return {key: parameters[key].default for key in KEYS if key in parameters
            and isinstance(parameters[key].default, (int, float)) and parameters[key].default is not True}


def check_callable(folder: Path, pipeline_class: type) -> None:
    """A folder loaded as a generic pipeline (its class is neither ours nor diffusers') has no `__call__`."""
    from ..errors import LoadError

    if _runtime_class(folder, pipeline_class) is None:
        raise LoadError(
            f"{str(folder)!r} loads as a generic pipeline (its model_index.json names a class that is neither this "
            "library's nor diffusers'), which cannot be called to make images. Load it in your own script with "
            "its class, or register the class (pipelines.register_class)."
        )


def describes_its_call(folder: Path, pipeline_class: type) -> bool:
    """Whether a plan can account for this pipeline's call: its class describes its inputs
    (`activation_inputs`), or the folder names a diffusers pipeline (its own `__call__` is captured)."""
    from ..hf.diffusers_pipeline import is_diffusers_folder
    from ..folder.model_index import ModelIndex

    return hasattr(pipeline_class, "activation_inputs") or is_diffusers_folder(ModelIndex.read(folder))


def _runtime_class(folder: Path, pipeline_class: type) -> Optional[type]:
    """The class whose `__call__` runs: ours, or for a generic load of a diffusers folder, the diffusers class."""
    from ..hf.diffusers_pipeline import diffusers_pipeline_class, is_diffusers_folder
    from ..folder.model_index import ModelIndex
    from ..framework.pipeline import Pipeline

    if pipeline_class is not Pipeline:
        return pipeline_class
    index = ModelIndex.read(folder)
    if not is_diffusers_folder(index):
        return None  # a generic pipeline of ours has no __call__ of its own
    return diffusers_pipeline_class(index)


def _default_sample_pixels(folder: Path) -> Optional[int]:
    vae = _config(folder / "vae")
    channels = vae.get("block_out_channels")
    for denoiser in DENOISERS:
        sample_size = _config(folder / denoiser).get("sample_size")
        if isinstance(sample_size, int) and isinstance(channels, list) and channels:
            return sample_size * 2 ** (len(channels) - 1)
    return None


def _config(component: Path) -> dict:
    from placement.errors import PlacementError

    from ..checkpoint.files import read_config_dict

    try:
        return read_config_dict(component)
    except PlacementError:  # absent or unreadable: this default stays unknown (the load reports the rest)
        return {}


def complete_call(planner: "TargetPlanner") -> list[str]:
    """`planner.call`'s height and width where it lacks them: the pipeline's own default size (as a run of it
    would use); the keys filled in. An error naming the flags when the pipeline has no default size."""
    from ..errors import LoadError

    call = planner.call
    missing = [key for key in ("height", "width") if call is not None and key not in call]
    if not missing:
        return []
    defaults = target_defaults(planner)
    if any(key not in defaults for key in missing):
        given = ", ".join("--" + _FLAGS.get(key, key).replace("_", "-") for key in call)
        raise LoadError(f"{given} plan(s) for a call, and {planner.target!r} has no default image size to "
                               "make it at: give --height and --width too.")
    planner.call = {**{key: call.get(key, defaults.get(key)) for key in ("height", "width")}, **call}
    return missing


def target_defaults(planner: "TargetPlanner") -> dict[str, Any]:
    """{height, width, num_inference_steps, guidance_scale} the target's pipeline uses when not told."""
    from ..hf.quiet import hf_libraries, quiet
    from ..text_to_image.pipeline import TextToImagePipeline
    from .targets import is_preset, pipeline_class_of

    if is_preset(planner.target):
        return class_defaults(TextToImagePipeline)
    folder = planner.folder()
    with quiet(preload=hf_libraries(folder)):
        return default_call(folder, pipeline_class_of(folder))


_FLAGS = {"num_inference_steps": "steps"}  # call keys whose flag has another name
