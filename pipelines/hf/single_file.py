"""Single-file checkpoints (a `.safetensors` of a model's original layout, or a `.gguf`), read by diffusers'
`from_single_file` with the config from a local folder. Planning runs diffusers' own single-file path on meta
tensors, so what is sized is what `from_single_file` will load and no tensor data is read."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Container, Iterable

import torch
from torch import nn

from ..checkpoint import TensorEntry, read_header
from ..errors import FolderError, LoadError, WeightsNotFoundError, list_names
from .quantizers import ComponentQuantization, QuantizationMethod

SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf")


def is_single_file(path: str | Path) -> bool:
    path = Path(path)
    return path.is_file() and path.suffix.lower() in SINGLE_FILE_SUFFIXES


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def meta_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors of their stored shapes and dtypes (headers only)."""
    if not is_gguf(path):
        return {entry.name: torch.empty(entry.shape, dtype=entry.dtype, device="meta") for entry in read_header(path)}
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    plain = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
             gguf.GGMLQuantizationType.BF16: torch.bfloat16}
    tensors = {}
    for info in _gguf_tensors(gguf, path):
        shape = tuple(int(size) for size in info.data.shape)
        if info.tensor_type in plain:
            tensors[info.name] = torch.empty(shape, dtype=plain[info.tensor_type], device="meta")
        else:
            packed = torch.empty(shape, dtype=torch.uint8, device="meta")
            tensors[info.name] = GGUFParameter(packed, quant_type=info.tensor_type)
    return tensors


def _gguf_tensors(gguf, path: Path) -> list:
    """The tensor infos of a GGUF file (memory-mapped: the shapes, no data read); a file that is not GGUF, or is cut
    short, is named with gguf's reason (gguf says it with a bare ValueError, numpy's reshape error for a cut file)."""
    try:
        return list(gguf.GGUFReader(str(path)).tensors)
    except OSError as error:
        raise WeightsNotFoundError(f"Cannot read the GGUF file {str(path)!r}: {error}.") from error
    except (ValueError, IndexError, KeyError, EOFError, OverflowError, struct.error) as error:
        raise FolderError(
            f"GGUF file {str(path)!r} is corrupt, truncated or not a GGUF file ({type(error).__name__}: {error}). "
            "Re-download or re-convert this file."
        ) from error


def gguf_quantization(dtype: torch.dtype | None) -> ComponentQuantization:
    """The quantizer diffusers needs to read a GGUF file: its layers compute in `dtype` (bfloat16 by default)."""
    from diffusers import GGUFQuantizationConfig

    config = GGUFQuantizationConfig(compute_dtype=dtype or torch.bfloat16)
    return ComponentQuantization(config=config, pre_quantized=True, method=QuantizationMethod.GGUF)


def check_single_file_class(cls: type, path: Path) -> None:
    if not callable(getattr(cls, "from_single_file", None)):
        raise LoadError(
            f"{path.name} is a single-file checkpoint, but {cls.__module__}.{cls.__name__} cannot be read from one "
            "(diffusers reads single files for its models that support from_single_file); save the model as a "
            "folder (save_pretrained) and load that."
        )


def build_on_meta(cls: type, path: Path, config_folder: Path, *, dtype: torch.dtype | None,
                  quantization: ComponentQuantization | None) -> nn.Module:
    """`cls` as `from_single_file(path, config=config_folder, ...)` will load it, built on meta."""
    check_single_file_class(cls, path)
    arguments: dict[str, Any] = {"config": str(config_folder), "local_files_only": True, "torch_dtype": dtype,
                                 "device": "meta"}
    if quantization is not None:
        arguments["quantization_config"] = quantization.config
    checkpoint = meta_checkpoint(path)
    check_holds_model(cls, checkpoint, path, config_folder)
    try:
        module = cls.from_single_file(checkpoint, **arguments)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError) as error:
        raise LoadError(
            f"{path.name} could not be read as a {cls.__name__} with the config in {str(config_folder)!r}: "
            f"{type(error).__name__}: {error}"
        ) from error
    if "hf_device_map" in vars(module):
        del module.hf_device_map  # diffusers' {'': meta}: where it goes is the plan's to say
    return module.eval()


def holds_component(cls: type, checkpoint: dict[str, torch.Tensor], config_folder: Path) -> bool:
    """Whether a single file's tensors (`meta_checkpoint`) hold every weight of a `cls` built from
    `config_folder`: its keys as they are, or once diffusers' mapping for the class converts them, on meta."""
    found = _compare(cls, checkpoint, config_folder)
    return found is not None and not found.missing


@dataclass(frozen=True, kw_only=True)
class _Comparison:
    expected: int  # how many weights the model has
    missing: list[str]  # the model's weights the file lacks (all of them when its keys are another layout's)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # key -> (the model's shape, the file's)


def _compare(cls: type, checkpoint: dict[str, torch.Tensor], config_folder: Path) -> _Comparison | None:
    """The file's tensors against the weights of a `cls` built on meta from `config_folder` (after diffusers'
    conversion of an original layout); None when diffusers reads no single file for `cls`."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import (
        SINGLE_FILE_LOADABLE_CLASSES,
        _get_single_file_loadable_mapping_class,
        _should_convert_state_dict_to_diffusers,
    )

    mapping = _get_single_file_loadable_mapping_class(cls)
    if mapping is None:
        return None
    config = cls.load_config(config_folder)
    with init_empty_weights():
        expected = cls.from_config(config).state_dict()
    converted = checkpoint
    if _should_convert_state_dict_to_diffusers(expected, checkpoint):
        try:
            converted = SINGLE_FILE_LOADABLE_CLASSES[mapping]["checkpoint_mapping_fn"](
                config=config, checkpoint=dict(checkpoint))
        except (KeyError, ValueError, IndexError, RuntimeError, TypeError):
            converted = checkpoint  # not an original layout it converts: compared as saved
    converted = converted or {}
    shapes = {name: (tuple(tensor.shape), tuple(converted[name].shape)) for name, tensor in expected.items()
              if name in converted and type(converted[name]) in (torch.Tensor, nn.Parameter)
              and tuple(converted[name].shape) != tuple(tensor.shape)}
    return _Comparison(expected=len(expected), missing=sorted(set(expected) - set(converted)), shapes=shapes)


def check_holds_model(cls: type, checkpoint: dict[str, torch.Tensor], path: Path, config_folder: Path) -> None:
    """A `LoadError` naming the file, the keys and the shapes when the file is not a whole `cls` of that config
    (diffusers' conversion fails on such files with a bare IndexError)."""
    found = _compare(cls, checkpoint, config_folder)
    if found is None:
        return
    start = f"{path.name} is not a {cls.__name__} of the config in {str(config_folder)!r}:"
    if found.missing:
        which = "none" if len(found.missing) == found.expected else f"{found.expected - len(found.missing)}"
        raise LoadError(
            f"{start} it holds {which} of its {found.expected} weights ({len(found.missing)} missing: "
            f"{list_names(found.missing)}), as saved or in an original layout diffusers converts. Give the file of "
            "this model (a file cut short, or another model's, cannot be loaded), or config= that model's folder."
        )
    if found.shapes:
        named = ", ".join(f"{key!r} {list(model)} in the model, {list(stored)} in the file"
                          for key, (model, stored) in sorted(found.shapes.items())[:5])
        raise LoadError(
            f"{start} {len(found.shapes)} tensor(s) have other shapes ({named}). The file is of another size of "
            "this model: give config= the folder of the model it was saved from."
        )


def checkpoint_float_dtype(path: Path) -> torch.dtype | None:
    """The floating dtype holding most of a safetensors file's bytes (GGUF: None, its layers compute in bf16)."""
    return None if is_gguf(path) else largest_float_dtype(read_header(path))


def largest_float_dtype(entries: Iterable[TensorEntry], names: Container[str] | None = None) -> torch.dtype | None:
    """The floating dtype holding most of the bytes of `entries` (checkpoint headers), among `names` when given."""
    by_dtype: dict[torch.dtype, int] = {}
    for entry in entries:
        if entry.dtype.is_floating_point and (names is None or entry.name in names):
            by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


__all__ = ["SINGLE_FILE_SUFFIXES", "build_on_meta", "check_holds_model", "check_single_file_class",
           "checkpoint_float_dtype", "gguf_quantization", "holds_component", "is_gguf", "is_single_file",
           "largest_float_dtype", "meta_checkpoint"]
