"""`quiet()`: silence what other libraries print while we plan, load and save (torchao kernel failures at
diffusers' import, transformers' bars, ...): third-party loggers pass errors only, their warnings are ignored
and transformers'/diffusers' bars are off; huggingface_hub's download bars stay. Blocks nest across threads: the
outermost one puts back exactly what it found, so the user's own code is never silenced."""

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
    """The Hugging Face libraries a load of `folder` imports: what `quiet(preload=...)` imports inside the block."""
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


def _hf_logging() -> dict:
    """{library: its `utils.logging` module} for the libraries of HF_LIBRARIES already imported."""
    return {name: importlib.import_module(f"{name}.utils.logging") for name in HF_LIBRARIES if name in sys.modules}


@contextmanager
def _hub_bars_kept() -> Iterator[None]:
    """transformers' and diffusers' bar switches also switch huggingface_hub's download bars: those stay as they
    were (a download is worth watching)."""
    from huggingface_hub import utils as hub

    were_on = not hub.are_progress_bars_disabled()
    yield
    (hub.enable_progress_bars if were_on else hub.disable_progress_bars)()


def _bars_off(was_on: dict[str, bool]) -> None:
    """Switch off the bars of the imported libraries not switched yet, recording in `was_on` whether they were."""
    with _hub_bars_kept():
        for library, switches in _hf_logging().items():
            if library not in was_on:
                was_on[library] = switches.is_progress_bar_enabled()
                switches.disable_progress_bar()


def _restore_bars(was_on: dict[str, bool]) -> None:
    with _hub_bars_kept():
        switches = _hf_logging()
        for library, on in was_on.items():
            if on:
                switches[library].enable_progress_bar()
