"""`quiet()`: silence what other libraries print while we plan, load and save, when it says nothing to our user.

Importing diffusers pulls in its quantizers, whose imports log that torchao's CUDA kernels cannot be loaded
("Failed to load ..._C_mxfp8...so"), that torchao's tensor types cannot be imported, or that bitsandbytes'
`kernels` package is missing; torch's `_pytree` logs that registering torchao's enums is deprecated;
transformers warns that an image processor falls back from torchvision to PIL and draws its "Loading weights"
and "Writing model shards" bars. None of it is about the user's pipeline, and our own messages (the plan, its
warnings, our load bar) already say what matters. Inside `with quiet():`

- the loggers of `THIRD_PARTY` packages pass errors only (a library imported inside the block is configured
  at its import: transformers and diffusers through their VERBOSITY variables, set for the block);
- Python warnings raised from their modules are ignored (ours, pointed at the user's code, still show);
- transformers' and diffusers' progress bars are off (huggingface_hub's download bars stay: a download is
  worth watching).

The library's plans, loads and saves run inside it (`pipeline_loader`, `single_model`, `Pipeline.save_pretrained`),
as does the CLI; `preload` imports libraries inside the block (`hf_libraries(folder)`: the ones a folder's load
will import), so that their import-time noise is silenced too and their bars are off before the load draws them.
Blocks nest, in one thread or several: the outermost one sets everything and puts back exactly what it found
when it ends (the user's own code after we return is never silenced). Errors are never silenced.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

THIRD_PARTY = ("transformers", "diffusers", "accelerate", "torchao", "bitsandbytes", "optimum", "gguf", "peft",
               "torch")
HF_LIBRARIES = ("diffusers", "transformers")
_VERBOSITY_VARIABLES = {"transformers": "TRANSFORMERS_VERBOSITY", "diffusers": "DIFFUSERS_VERBOSITY"}
_THIRD_PARTY_MODULES = r"^(" + "|".join(re.escape(name) for name in THIRD_PARTY) + r")(\.|$)"


class _Silence:
    """What the outermost block changed, to put back: one per process, guarded by `lock`."""

    def __init__(self):
        self.lock = threading.RLock()
        self.depth = 0
        self.variables: dict[str, Optional[str]] = {}
        self.levels: dict[str, int] = {}
        self.bars: dict[str, bool] = {}  # library -> its bars were on (switched off by a block)
        self.filter: Optional[tuple] = None

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            self.variables = {name: os.environ.get(name) for name in _VERBOSITY_VARIABLES.values()}
            os.environ.update({name: "error" for name in _VERBOSITY_VARIABLES.values()})
            self.levels = {name: logging.getLogger(name).level for name in THIRD_PARTY}
            warnings.filterwarnings("ignore", module=_THIRD_PARTY_MODULES)
            self.filter = warnings.filters[0]
            self.bars = {}

    def settle(self) -> None:
        """Third-party loggers at ERROR and bars off, again: a library imported since has set its own."""
        with self.lock:
            for name in THIRD_PARTY:
                logging.getLogger(name).setLevel(logging.ERROR)
            _bars_off(self.bars)

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0:
                return
            _restore_bars(self.bars)
            for name, value in self.variables.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            for name, level in self.levels.items():
                logging.getLogger(name).setLevel(level or _default_level(name))
            if self.filter in warnings.filters:
                warnings.filters.remove(self.filter)
                mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings itself calls
                if mutated is not None:
                    mutated()


_SILENCE = _Silence()


@contextmanager
def quiet(preload: Iterable[str] = ()) -> Iterator[None]:
    """Third-party log lines below ERROR, their warnings and their progress bars off inside the block."""
    _SILENCE.enter()
    try:
        for library in preload:
            _import_if_installed(library)
        _SILENCE.settle()
        yield
    finally:
        _SILENCE.leave()


def hf_libraries(folder: Optional[Path]) -> tuple[str, ...]:
    """The Hugging Face libraries a load of `folder` imports (a pipeline folder's components or class, a model
    folder's config): what `quiet(preload=...)` should import inside the block."""
    from ..folder.model_index import ModelIndex
    from placement.errors import PlacementError

    if folder is None or not Path(folder).is_dir():
        return ()
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        try:
            index = ModelIndex.read(folder)
        except PlacementError:  # the load reads it again and reports the problem in its own words
            return ()
        named = {spec.library for spec in index.components.values()}
        named |= {"diffusers"} if "_diffusers_version" in index.metadata else set()
    else:
        named = _config_libraries(folder / "config.json")
    return tuple(library for library in HF_LIBRARIES if library in named)


def _config_libraries(path: Path) -> set[str]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(config, dict):
        return set()
    return ({"diffusers"} if "_diffusers_version" in config else set()) | (
        {"transformers"} if "transformers_version" in config or "architectures" in config else set())


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
    """{library: its `utils.logging` module} for the libraries of HF_LIBRARIES already imported."""
    switches = {}
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        switches["transformers"] = transformers_logging
    if "diffusers" in sys.modules:
        from diffusers.utils import logging as diffusers_logging

        switches["diffusers"] = diffusers_logging
    return switches


def _bars_off(was_on: dict[str, bool]) -> None:
    """Switch off the bars of the imported libraries not switched yet, recording in `was_on` whether they were."""
    from huggingface_hub import utils as hub

    hub_bars_were_on = not hub.are_progress_bars_disabled()
    for library, switches in _bar_switches().items():
        if library not in was_on:
            was_on[library] = switches.is_progress_bar_enabled()
            switches.disable_progress_bar()
    if hub_bars_were_on:  # their switch also turns off huggingface_hub's download bars: keep those
        hub.enable_progress_bars()


def _restore_bars(was_on: dict[str, bool]) -> None:
    from huggingface_hub import utils as hub

    hub_bars_were_on = not hub.are_progress_bars_disabled()
    switches = _bar_switches()
    for library, on in was_on.items():
        if on:
            switches[library].enable_progress_bar()
    if not hub_bars_were_on:
        hub.disable_progress_bars()
