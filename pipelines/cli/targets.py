"""What a command's TARGET is (a preset, a local folder, a Hub id) and its plan.

Imported when a command runs (it imports torch through `placement` and `pipelines`), never for `--help`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from placement import Plan
from ..errors import LoadError

from ..hf.quiet import hf_libraries, quiet  # noqa: F401 - hf_libraries: the commands import it from here

STEPS = "num_inference_steps"


def is_preset(target: str) -> bool:
    from ..text_to_image.presets import PRESETS

    return target in PRESETS and not Path(target).exists()


def target_folder(target: str) -> Path:
    """TARGET as a local folder (a Hub id: its configs downloaded); not found: what TARGET may have meant."""
    from ..folder.sources import looks_like_a_path
    from ..folder.sources import resolve_pipeline_folder
    from ..text_to_image.presets import PRESETS

    path = Path(target).expanduser()
    typo = preset_typo(target) if not path.exists() else None
    if typo is not None:  # said before the Hub is asked: a Hub id is owner/name, never one edit from a preset
        raise LoadError(f"{target!r} is not a preset; did you mean {typo!r}? (the presets: {', '.join(PRESETS)}; "
                              "otherwise give a folder or a Hub id owner/name)")
    if path.exists() or looks_like_a_path(target):
        if not path.exists():
            raise LoadError(f"No such folder: {target!r} (looked for {str(path.resolve())!r}). Check the path; "
                                  "a Hub id is written owner/name.")
        return resolve_pipeline_folder(path, weights=False)
    try:
        return resolve_pipeline_folder(target, weights=False)
    except Exception as error:  # the Hub (or the network) said no: say what TARGET may be
        close = difflib.get_close_matches(target, PRESETS, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        raise LoadError(
            f"{target!r} is not a preset ({', '.join(PRESETS)}{guess}), nor a local folder, and the Hub did not "
            f"give it: {type(error).__name__}: {error}"
        ) from error


def preset_typo(target: str) -> str | None:
    """The preset `target` is one edit from (a letter added, dropped or changed, '_' for '-', case), or None."""
    from ..text_to_image.presets import PRESETS

    spelled = target.lower().replace("_", "-")
    return next((name for name in PRESETS if name != target and _one_edit(spelled, name)), None)


def _one_edit(a: str, b: str) -> bool:
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def pipeline_class_of(folder: Path) -> type:
    """The folder's own pipeline class when it is one of ours (so call= works), else the generic Pipeline."""
    import pipelines

    from ..folder.model_index import ModelIndex
    from ..framework.pipeline import Pipeline

    found = getattr(pipelines, ModelIndex.read(folder).class_name, None)
    return found if isinstance(found, type) and issubclass(found, Pipeline) else Pipeline


@dataclass(kw_only=True)
class TargetPlanner:
    """`planner(torch_dtype=...)`: the plan of TARGET with these options, made quietly (see `pipelines.hf.quiet`).

    `call` may hold num_inference_steps (`--steps`): the planner weighs streaming by the runs per call.
    `layerwise_casting` ({component: fp8 dtype name}, `--layerwise-casting`) plans a folder's components with fp8
    storage; a preset is built in memory, not loaded, so it has no load to cast at."""

    target: str
    device_map: Any
    max_memory: Optional[Mapping]
    offload_folder: Optional[Path]
    call: Optional[Mapping[str, Any]]
    layerwise_casting: Optional[Mapping[str, str]] = None
    gpu: Optional[str] = None  # --gpu: the GPU the plan's seconds per call assume
    notes: list[str] = field(default_factory=list)
    _folder: Optional[Path] = field(default=None, repr=False)  # resolved once (a Hub id: downloaded once)

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = target_folder(self.target)
        return self._folder

    def __call__(self, *, torch_dtype) -> Plan:
        from ..loading.planning import plan_pipeline
        from ..text_to_image.pipeline import TextToImagePipeline

        options = dict(device_map=self.device_map, max_memory=self.max_memory, torch_dtype=torch_dtype,
                       offload_folder=self.offload_folder, call=self.call, gpu=self.gpu)
        if is_preset(self.target):
            if self.layerwise_casting:
                raise LoadError(f"--layerwise-casting plans a saved folder's load; save the {self.target} "
                                       "preset first (placement demo saves one), then plan that folder.")
            with quiet():
                pipe = TextToImagePipeline.from_preset(self.target, device="meta")
                return plan_pipeline(pipe, pinned={}, **options)
        folder = self.folder()
        if self.layerwise_casting:
            options["layerwise_casting"] = dict(self.layerwise_casting)
        with quiet(preload=hf_libraries(folder)):
            return pipeline_class_of(folder).plan_placement(folder, **options)
