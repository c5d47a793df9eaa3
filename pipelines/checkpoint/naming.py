"""File names of the checkpoint folder format, exactly as diffusers and transformers write them.

diffusers: `diffusion_pytorch_model.safetensors`, shards `diffusion_pytorch_model-00001-of-00003.safetensors`
with the index `diffusion_pytorch_model.safetensors.index.json`. transformers uses the stem `model`.
A variant is inserted before the last suffix, as `diffusers.utils._add_variant` does it:
`diffusion_pytorch_model.fp16.safetensors`, shards `diffusion_pytorch_model.fp16-00001-of-00002.safetensors`,
index `diffusion_pytorch_model.safetensors.index.fp16.json`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model"
TRANSFORMERS_WEIGHTS_NAME = "model"
CONFIG_NAME = "config.json"
SAFETENSORS = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_VARIANT = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True, kw_only=True)
class WeightsNaming:
    """The names of one model's weight files for one variant (None = the default, unsuffixed weights)."""

    weights_name: str = DIFFUSERS_WEIGHTS_NAME
    variant: str | None = None

    def __post_init__(self):
        if self.variant is not None and not _VARIANT.match(self.variant):
            raise ValueError(
                f"Invalid variant {self.variant!r}: use letters, digits and '_' only (e.g. 'fp16'), "
                "because the variant becomes part of the file names."
            )

    @property
    def _stem(self) -> str:
        return self.weights_name if self.variant is None else f"{self.weights_name}.{self.variant}"

    @property
    def single_file(self) -> str:
        return f"{self._stem}{SAFETENSORS}"

    @property
    def index_file(self) -> str:
        suffix = "" if self.variant is None else f".{self.variant}"
        return f"{self.weights_name}{SAFETENSORS}.index{suffix}.json"

    @property
    def shard_pattern(self) -> str:
        """The `filename_pattern` of `huggingface_hub.split_torch_state_dict_into_shards`."""
        return f"{self._stem}{{suffix}}{SAFETENSORS}"

    def shard_file(self, number: int, total: int) -> str:
        return f"{self._stem}-{number:05d}-of-{total:05d}{SAFETENSORS}"

    def owns(self, filename: str) -> bool:
        """Whether a save of this naming writes (and so may replace) `filename`."""
        if filename in (self.single_file, self.index_file):
            return True
        shard = re.fullmatch(re.escape(self._stem) + r"-\d{5}-of-\d{5}" + re.escape(SAFETENSORS), filename)
        return shard is not None

    def allow_patterns(self, subfolder: str | None = None) -> list[str]:
        """`snapshot_download` patterns that fetch exactly this model's config and weights."""
        names = [CONFIG_NAME, self.single_file, self.index_file, f"{self._stem}-*-of-*{SAFETENSORS}"]
        return [f"{subfolder.strip('/')}/{n}" if subfolder else n for n in names]


def variants_in(folder: Path, weights_name: str) -> list[str]:
    """The variants with safetensors weights in `folder`, "default" standing for the unsuffixed ones."""
    stem = re.escape(weights_name)
    weights = re.compile(rf"^{stem}(?:\.(?P<variant>[A-Za-z0-9_]+))?(?:-\d{{5}}-of-\d{{5}})?\.safetensors$")
    index = re.compile(rf"^{stem}\.safetensors\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$")
    found = set()
    for path in folder.iterdir() if folder.is_dir() else ():
        match = weights.match(path.name) or index.match(path.name)
        if match:
            found.add(match.group("variant") or "default")
    return sorted(found)


# The stems of pickle weights, per safetensors stem: transformers writes `pytorch_model.bin` beside `model.safetensors`.
_PICKLE_STEMS = {TRANSFORMERS_WEIGHTS_NAME: (TRANSFORMERS_WEIGHTS_NAME, "pytorch_model")}


def pickle_files_in(folder: Path, weights_name: str) -> list[str]:
    """Weights saved with pickle (`.bin`, ...): we never unpickle, but the error should say they are there."""
    if not folder.is_dir():
        return []
    stems = _PICKLE_STEMS.get(weights_name, (weights_name,))
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(stems) and p.suffix in PICKLE_SUFFIXES)
