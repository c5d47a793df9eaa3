"""Find a model's weights (one safetensors file, or shards listed by an index json) and check them against the
model, from the headers alone: a 20 GB checkpoint is inspected in milliseconds, and every problem (a missing
shard, a truncated file, a key or shape mismatch, a dtype the model cannot take) is reported before a weight
moves. Without `torch_dtype`, one float parameter stored in another float dtype than the rest would fail at the
first call, so it is refused here; integer and bool tensors are never cast."""

from __future__ import annotations

import json
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointShapeError, FolderError, WeightsNotFoundError, list_names
from .files import DIFFUSERS_WEIGHTS_NAME, WeightsNaming, file_identity, parse_json, pickle_files_in, variants_in


# safetensors dtype codes -> torch dtypes (the codes `safe_open(...).get_slice(k).get_dtype()` returns).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class WeightsIndex:
    folder: Path
    naming: WeightsNaming
    index_file: Path | None
    tensors: Mapping[str, TensorEntry]
    # each file's identity (`file_identity`) before its header was read: what disk-homed reads check against
    identities: Mapping[Path, Mapping[str, int]] = field(default_factory=dict)

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(entry.file for entry in self.tensors.values()))

    @property
    def is_sharded(self) -> bool:
        return self.index_file is not None

    def offload_index(self, names: Iterable[str] | Mapping[str, str], dtype_of, *,
                      tied_weights: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
        """accelerate's offload index serving model tensors from the checkpoint files themselves (no copy).

        `names`: model tensor names (a tied one absent from the checkpoint served by its source in `tied_weights`),
        or {model name: checkpoint name}; `dtype_of(entry)`: the dtype each is read back as."""
        if isinstance(names, Mapping):
            sources = dict(names)
        else:
            tied = tied_weights or {}
            sources = {name: name if name in self.tensors else tied.get(name, name) for name in names}
        unserved = sorted(name for name, source in sources.items() if source not in self.tensors)
        if unserved:
            raise FolderError(
                f"No tensor of the checkpoint in {str(self.folder)!r} can serve {list_names(unserved)} from disk; "
                "if they are tied weights, pass tied_weights={tied name: source name}."
            )
        index = {}
        for name, source in sources.items():
            entry = self.tensors[source]
            index[name] = {
                "safetensors_file": str(entry.file),
                "weight_name": source,
                "dtype": str(dtype_of(entry)).removeprefix("torch."),
            }
        return index


def find_weights(folder: str | Path, *, weights_name: str = DIFFUSERS_WEIGHTS_NAME,
                 variant: str | None = None) -> WeightsIndex:
    """The weights of the model in `folder` (`weights_name`: "diffusion_pytorch_model", or "model" for transformers)."""
    folder = Path(folder)
    naming = WeightsNaming(weights_name=weights_name, variant=variant)
    if not folder.is_dir():
        raise WeightsNotFoundError(f"Checkpoint folder {str(folder)!r} does not exist or is not a folder.")
    index_path = folder / naming.index_file
    single = folder / naming.single_file
    _refuse_special_files([index_path, single])
    if index_path.is_file():
        weight_map = _read_index(index_path)
        identities = _identities(folder / name for name in weight_map.values())  # before the headers are read
        tensors = _tensors_from_index(folder, index_path, weight_map)
        return WeightsIndex(folder=folder, naming=naming, index_file=index_path, tensors=tensors,
                            identities=identities)
    if single.is_file():
        identities = _identities([single])
        tensors = {entry.name: entry for entry in read_header(single)}
        return WeightsIndex(folder=folder, naming=naming, index_file=None, tensors=tensors, identities=identities)
    raise _no_weights_error(folder, naming)


def _identities(paths: Iterable[Path]) -> dict[Path, dict[str, int]]:
    """Each file's identity (`file_identity`) as found, absent ones left out (their error comes with the headers)."""
    found = {}
    for path in dict.fromkeys(paths):
        try:
            found[path] = file_identity(path)
        except OSError:
            continue
    return found


def read_header(path: Path) -> list[TensorEntry]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return [_entry(handle, name, path) for name in handle.offset_keys()]
    except SafetensorError as error:
        raise FolderError(
            f"Safetensors file {str(path)!r} is corrupt or truncated ({error}). "
            "Re-download or re-save this file."
        ) from error
    except OSError as error:
        raise WeightsNotFoundError(f"Cannot read weights file {str(path)!r}: {error}.") from error


def _entry(handle, name: str, path: Path) -> TensorEntry:
    tensor_slice = handle.get_slice(name)
    code = tensor_slice.get_dtype()
    if code not in SAFETENSORS_DTYPES:
        raise FolderError(f"Tensor {name!r} in {str(path)!r} has unsupported dtype {code!r}.")
    return TensorEntry(name=name, file=path, shape=tuple(tensor_slice.get_shape()), dtype=SAFETENSORS_DTYPES[code])


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        content = parse_json(index_path.read_text(encoding="utf-8"), index_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FolderError(f"Index file {str(index_path)!r} is not valid JSON ({error}).") from error
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FolderError(
            f"Index file {str(index_path)!r} has no 'weight_map' object of tensor name -> shard file name."
        )
    outside = sorted({file for file in weight_map.values() if not is_plain_file_name(file)})
    if outside:
        raise FolderError(
            f"Index file {str(index_path)!r} names shard file(s) {list_names(outside)}, which are not plain file "
            "names in its folder (no '/', '\\', '..' or absolute paths allowed); nothing was read from them. "
            "Fix the index's weight_map to name files next to it."
        )
    return weight_map


def is_plain_file_name(name: str) -> bool:
    """A file directly in the component folder: a symlink there (as in the HF cache) is fine, a path is not."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name \
        and not Path(name).is_absolute()


def _refuse_special_files(paths: Iterable[Path]) -> None:
    """A FIFO, a device or a folder under a weights name would block, read without end or pass for a missing file."""
    for path in paths:
        try:
            mode = path.stat().st_mode
        except OSError:  # absent (or a dangling link): the caller says what is missing
            continue
        if not stat.S_ISREG(mode):
            raise FolderError(
                f"{str(path)!r} is {_kind_of(mode)}, not a regular file: weights are read from regular safetensors "
                "files only. Put the real file there (re-download or re-save the checkpoint)."
            )


def _kind_of(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "a special file")


def _tensors_from_index(folder: Path, index_path: Path, weight_map: dict[str, str]) -> dict[str, TensorEntry]:
    shard_names = list(dict.fromkeys(weight_map.values()))
    _refuse_special_files([folder / name for name in shard_names])
    missing = [name for name in shard_names if not (folder / name).is_file()]
    if missing:
        raise WeightsNotFoundError(
            f"Index {index_path.name!r} in {str(folder)!r} names shard file(s) that do not exist: "
            f"{list_names(missing)}. The checkpoint is incomplete: re-download or re-save it."
        )
    tensors: dict[str, TensorEntry] = {}
    for shard_name in shard_names:
        in_file = {entry.name: entry for entry in read_header(folder / shard_name)}
        wanted = [name for name, file in weight_map.items() if file == shard_name]
        absent = [name for name in wanted if name not in in_file]
        if absent:
            raise FolderError(
                f"Index {index_path.name!r} says shard {shard_name!r} holds {list_names(absent)}, "
                "but that file does not contain them. The index and shards come from different saves."
            )
        tensors.update((name, in_file[name]) for name in wanted)
    return tensors


def _no_weights_error(folder: Path, naming: WeightsNaming) -> WeightsNotFoundError:
    variants = variants_in(folder, naming.weights_name)
    wanted = naming.variant or "default"
    if wanted in variants:  # shards are there but their index is not
        return WeightsNotFoundError(
            f"Shard files of {naming.weights_name!r} are in {str(folder)!r} but their index "
            f"{naming.index_file!r} is missing, so the shards cannot be assembled. Re-download or re-save it."
        )
    if variants:
        return WeightsNotFoundError(
            f"No {wanted!r} variant of {naming.weights_name!r} weights in {str(folder)!r} "
            f"(looked for {naming.single_file!r} or {naming.index_file!r}). Variants present: "
            f"{', '.join(variants)}; pass variant= one of them ('default' means variant=None)."
        )
    pickles = pickle_files_in(folder, naming.weights_name)
    if pickles:
        return WeightsNotFoundError(
            f"{str(folder)!r} holds only pickle weights ({list_names(pickles)}), which are never unpickled "
            "here: unpickling can run arbitrary code, reading safetensors cannot. Convert them once, with the library "
            "that saved them and only if you trust the file: "
            "ModelClass.from_pretrained(folder).save_pretrained(folder) writes safetensors (transformers' and "
            "diffusers' save_pretrained(safe_serialization=True), their default); or opt in explicitly: "
            "Pipeline.from_pretrained(..., device_map=None, use_safetensors=False) lets the owner library read them "
            "(torch.load(weights_only=True))."
        )
    return WeightsNotFoundError(
        f"No weights in {str(folder)!r}: expected {naming.single_file!r}, or {naming.index_file!r} with its shards."
    )


def check_dtypes(module: nn.Module, weights: WeightsIndex, *, dtype: torch.dtype | None,
                 keep_in_fp32: Iterable[str] = (), model_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise `FolderError` for tensors of `weights` the model `module` (on meta) cannot take."""
    model = dict(module.state_dict(keep_vars=True)) if model_tensors is None else model_tensors
    matched = {name: entry for name, entry in weights.tensors.items() if name in model}
    kinds = [f"{name!r}: checkpoint {_short(entry.dtype)}, model {_short(model[name].dtype)}"
             for name, entry in sorted(matched.items()) if _kind_differs(entry.dtype, model[name].dtype)]
    if kinds:
        raise FolderError(
            f"Checkpoint {str(weights.folder)!r} holds tensors of another kind than the model's: {'; '.join(kinds)}. "
            "Integer and bool tensors are never cast; re-save the checkpoint with the model's dtypes."
        )
    if dtype is not None:
        return
    keep = tuple(keep_in_fp32)
    parameters = {name for name, tensor in model.items() if isinstance(tensor, nn.Parameter)}
    floats = {name: entry for name, entry in matched.items()
              if name in parameters and entry.dtype.is_floating_point and not _kept(name, keep)}
    _check_one_float_dtype(floats, weights)


def _check_one_float_dtype(floats: dict[str, TensorEntry], weights: WeightsIndex) -> None:
    counts = Counter(entry.dtype for entry in floats.values())
    if len(counts) < 2:
        return
    dominant = counts.most_common(1)[0][0]
    odd = [f"{name} ({_short(entry.dtype)})" for name, entry in floats.items() if entry.dtype != dominant]
    raise FolderError(
        f"Checkpoint {str(weights.folder)!r} mixes float dtypes: {len(floats) - len(odd)} parameter(s) are "
        f"{_short(dominant)} but {len(odd)} are not: {list_names(odd)}. Loaded as is, the model would fail at its "
        f"first call; pass torch_dtype (e.g. torch_dtype=torch.{_short(dominant)}) to cast them all, or re-save it."
    )


def _kind_differs(saved: torch.dtype, model: torch.dtype) -> bool:
    if saved.is_floating_point and model.is_floating_point:
        return False  # a cast or the checkpoint's own dtype: decided by torch_dtype
    return saved != model


def _kept(name: str, keep_in_fp32: tuple[str, ...]) -> bool:
    return bool(keep_in_fp32) and any(part in keep_in_fp32 for part in name.split("."))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expected_shapes(module: nn.Module, model_tensors: Mapping[str, torch.Tensor] | None = None
                    ) -> dict[str, tuple[int, ...]]:
    """Parameters and persistent buffers: every tensor the checkpoint must provide."""
    tensors = module.state_dict(keep_vars=True) if model_tensors is None else model_tensors
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def validate_weights(module: nn.Module, weights: WeightsIndex, *, tied_weights: Mapping[str, str] | None = None,
                     ignore_unexpected: Iterable[str] = (), model_tensors: Mapping[str, torch.Tensor] | None = None
                     ) -> None:
    """Raise if a key is missing or unexpected, or a shape differs, naming each.

    Tied weights may be absent (re-tied after loading); keys matching an `ignore_unexpected` regex may be extra."""
    expected = expected_shapes(module, model_tensors)
    tied = set(tied_weights or ())
    present = set(weights.tensors)
    ignored = [re.compile(pattern) for pattern in ignore_unexpected]
    missing = sorted(set(expected) - present - tied)
    unexpected = sorted(k for k in present - set(expected) if not any(p.search(k) for p in ignored))
    where = _describe(weights)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) the model needs: {list_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) the model does not have: {list_names(unexpected)}")
        raise FolderError(
            f"Checkpoint {where} does not match {type(module).__name__}: {'; '.join(parts)}. "
            "Check that the config and the weights come from the same model."
        )
    mismatched = _shape_mismatches(expected, weights, present & set(expected))
    if mismatched:
        raise CheckpointShapeError(
            f"Checkpoint {where} does not match {type(module).__name__}: shape mismatch for "
            f"{'; '.join(mismatched)}. Check that config.json matches the weights."
        )


def _shape_mismatches(expected, weights: WeightsIndex, names: Iterable[str]) -> list[str]:
    mismatched = []
    for name in sorted(names):
        entry = weights.tensors[name]
        if tuple(entry.shape) != expected[name]:
            mismatched.append(
                f"{name!r}: checkpoint {list(entry.shape)} in {entry.file.name!r}, model {list(expected[name])}"
            )
    return mismatched


def _describe(weights: WeightsIndex) -> str:
    source = (weights.index_file or weights.files[0]) if weights.files else weights.folder
    return repr(str(source))
