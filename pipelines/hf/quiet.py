"""`quiet()`: silence what other libraries print while we plan and load, when it says nothing to our user.

Importing diffusers pulls in its quantizers, whose imports log that torchao's CUDA kernels or bitsandbytes'
`kernels` package are missing on this machine; transformers warns that an image processor falls back from
torchvision to PIL and draws its own "Loading weights" bar; torch warns about deprecated internals those
libraries call. None of it is about the user's pipeline, and our own messages (the plan, its warnings, our
load bar) already say what matters. Inside `with quiet():`

- the loggers of `THIRD_PARTY` packages pass errors only (a library imported inside the block is configured
  at its import: transformers and diffusers through their VERBOSITY variables, set for the block);
- Python warnings raised from their modules are ignored (ours, pointed at the user's code, still show);
- transformers' and diffusers' progress bars are off (huggingface_hub's download bars stay: a download is
  worth watching).

`preload` imports libraries inside the block, so that their import-time noise is silenced too and their bars
can be switched off before the load uses them. Everything is restored on exit. Errors are never silenced.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator

THIRD_PARTY = ("transformers", "diffusers", "accelerate", "torchao", "bitsandbytes", "optimum", "gguf", "peft",
               "torch")
_BARS = ("transformers", "diffusers")  # libraries with a `utils.logging.disable_progress_bar()`
_VERBOSITY_VARIABLES = {"transformers": "TRANSFORMERS_VERBOSITY", "diffusers": "DIFFUSERS_VERBOSITY"}
_THIRD_PARTY_MODULES = r"^(" + "|".join(re.escape(name) for name in THIRD_PARTY) + r")(\.|$)"


@contextmanager
def quiet(preload: Iterable[str] = ()) -> Iterator[None]:
    """Third-party log lines below ERROR, their warnings and their progress bars off inside the block."""
    saved_variables = {name: os.environ.get(name) for name in _VERBOSITY_VARIABLES.values()}
    os.environ.update({name: "error" for name in _VERBOSITY_VARIABLES.values()})
    saved_levels = {name: logging.getLogger(name).level for name in THIRD_PARTY}
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.ERROR)
    bars: dict[str, bool] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=_THIRD_PARTY_MODULES)
            for library in preload:
                _import_if_installed(library)
            for name in THIRD_PARTY:  # again: a library imported above has set its own level
                logging.getLogger(name).setLevel(logging.ERROR)
            bars = _bars_off()
            yield
    finally:
        _restore_bars(bars)
        for name, value in saved_variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level or _default_level(name))


def _import_if_installed(library: str) -> None:
    try:
        importlib.import_module(library)
    except ImportError:  # not installed: the load that needs it says so in its own words
        pass


def _default_level(name: str) -> int:
    """The level a library imported inside the block would have had: its VERBOSITY variable, else WARNING
    (transformers' and diffusers' default); NOTSET for the others, which do not configure their loggers."""
    if name not in _VERBOSITY_VARIABLES or name not in sys.modules:
        return logging.NOTSET
    chosen = os.environ.get(_VERBOSITY_VARIABLES[name], "warning").upper()
    return logging.getLevelName(chosen) if isinstance(logging.getLevelName(chosen), int) else logging.WARNING


def _bar_switches() -> dict:
    """{library: its `utils.logging` module} for the libraries of `_BARS` already imported."""
    switches = {}
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        switches["transformers"] = transformers_logging
    if "diffusers" in sys.modules:
        from diffusers.utils import logging as diffusers_logging

        switches["diffusers"] = diffusers_logging
    return switches


def _bars_off() -> dict[str, bool]:
    """Switch off the bars of the imported libraries of `_BARS`; {library: was it on}."""
    from huggingface_hub import utils as hub

    hub_bars_were_on = not hub.are_progress_bars_disabled()
    was_on = {}
    for library, switches in _bar_switches().items():
        was_on[library] = switches.is_progress_bar_enabled()
        switches.disable_progress_bar()
    if hub_bars_were_on:  # their switch also turns off huggingface_hub's download bars: keep those
        hub.enable_progress_bars()
    return was_on


def _restore_bars(was_on: dict[str, bool]) -> None:
    from huggingface_hub import utils as hub

    hub_bars_were_on = not hub.are_progress_bars_disabled()
    switches = _bar_switches()
    for library, on in was_on.items():
        if on:
            switches[library].enable_progress_bar()
    if not hub_bars_were_on:
        hub.disable_progress_bars()
