"""What call capture cannot see by running a pipeline's `__call__` as it is: each row with its reason.

Capture (`capture.py`) runs the pipeline's own code; these are the few places where that code, run on stand-ins
for planning, must be helped. Nothing here names a pipeline class.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

from placement.activations.isolation import loggers_at_error

# Inputs a call needs that `call=` may leave out: without them an img2img, inpaint, ControlNet or image-to-video
# pipeline refuses to run (or, for an optional conditioning image such as FLUX Kontext's, plans a smaller call
# than the one it is for). A blank one of the call's size costs what a real one does: only sizes matter.
STAND_IN_INPUTS = ("image", "mask_image", "control_image", "video", "mask")
# Of those, the ones a video pipeline takes as a list of frames (Wan VACE's `video` and `mask`).
VIDEO_INPUTS = ("video", "mask")


@contextlib.contextmanager
def blank_results_not_converted(pipe: Any) -> Iterator[None]:
    """The decoded result handed back as it is: its post-processing (denormalising, PIL or numpy conversion) costs
    seconds for a video and runs no component, so every image/video processor's `postprocess` is skipped."""
    patched = []
    for processor in list(vars(pipe).values()):
        for method in ("postprocess", "postprocess_video"):
            if callable(getattr(type(processor), method, None)) and not isinstance(processor, type):
                setattr(processor, method, _returned_as_is)
                patched.append((processor, method))
    try:
        yield
    finally:
        for processor, method in patched:
            vars(processor).pop(method, None)


def _returned_as_is(*args: Any, **kwargs: Any) -> Any:
    """The processed thing itself: the first argument, or the keyword naming it (`video=`, `image=`)."""
    return args[0] if args else kwargs.get("video", kwargs.get("image"))


@contextlib.contextmanager
def optional_text_cleaning(pipe: Any) -> Iterator[None]:
    """diffusers 0.42's Wan image-to-video and VACE pipelines call `ftfy.fix_text` without checking that ftfy is
    installed (the text-to-video one checks): without it, planning their call would fail where cleaning the
    prompt's text changes no shape. A stand-in that leaves the text as it is, for the length of the capture."""
    module = sys.modules.get(type(pipe).__module__)
    missing = module is not None and "ftfy" not in vars(module) and _mentions(module, "ftfy.fix_text")
    if missing:
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    try:
        yield
    finally:
        if missing:
            del module.ftfy


def _mentions(module: types.ModuleType, text: str) -> bool:
    source = getattr(module, "__file__", None)
    if not source:
        return False
    try:
        with open(source, encoding="utf-8") as file:
            return text in file.read()
    except OSError:
        return False


@contextlib.contextmanager
def progress_bar_off(pipe: Any) -> Iterator[None]:
    """No step bar while planning: the user sees the plan, not a bar of a call that is not really run."""
    saved = dict(getattr(pipe, "_progress_bar_config", {}) or {})
    pipe.set_progress_bar_config(disable=True)
    try:
        yield
    finally:
        pipe._progress_bar_config = saved


@contextlib.contextmanager
def libraries_quiet() -> Iterator[None]:
    """diffusers' and transformers' warnings about the call (a long prompt truncated at the maximum sequence
    length, which the default prompt is on purpose) say nothing about the plan: silenced while capturing."""
    with loggers_at_error("diffusers", "transformers"):
        yield
