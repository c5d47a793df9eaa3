"""The load options of formats of their own (quantization, fp8 layerwise casting, pins), checked before anything
is built, and what each quantized format can do once placed, checked when the plan is made.

What a format can do in our runtime (tested in tests/pipelines/loading/test_quantized_offload.py):
- bitsandbytes: a 4-/8-bit weight is a `Params4bit`/`Int8Params` whose quantization state lives beside its
  data; moved whole with its module it stays valid (whole, split, the CPU), but offloading swaps tensors one by
  one and would keep the data without its state: offloaded or disk placements are refused at plan time;
- torchao, quanto and GGUF tensors are tensor subclasses moved as they are (their inner int8/fp8 data and
  scales): whole, split, CPU and offloaded (host RAM) placements work; "disk" would write them to safetensors
  files, which hold plain tensors only, so it is refused at plan time.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from hooks.layerwise_casting import apply_layerwise_casting
from placement.plan_schema import PlacementKind, Plan
from placement.sizes import format_bytes

from ..errors import LoadError
from ..hf.hf_interop import load_without_device_map
from ..hf.quantizers import QuantizationMethod, check_requested_names, format_label, requested_quantization
from .layerwise import casting_config, compute_dtype
from .meta_records import MetaComponent
from .request import LoadRequest


class FormatPlacementError(LoadError, ValueError):
    """A plan that puts a quantized component where its format cannot run (e.g. bitsandbytes offloaded)."""


class FormatOptionError(LoadError, ValueError):
    """`quantization_config=`, `layerwise_casting=` or `pin=` naming what the load does not have."""


# Placement kinds each quantized format cannot take in our runtime, with why (see the module docstring).
_REFUSED: dict[QuantizationMethod, dict[PlacementKind, str]] = {
    QuantizationMethod.BITSANDBYTES_4BIT: {
        PlacementKind.OFFLOADED: "its packed weights and their quantization state cannot be streamed apart",
        PlacementKind.DISK: "its packed weights and their quantization state cannot be streamed apart",
    },
    QuantizationMethod.TORCHAO: {PlacementKind.DISK: "safetensors offload files hold plain tensors only"},
    QuantizationMethod.QUANTO: {PlacementKind.DISK: "safetensors offload files hold plain tensors only"},
    QuantizationMethod.GGUF: {PlacementKind.DISK: "safetensors offload files hold plain tensors only"},
}
_REFUSED[QuantizationMethod.BITSANDBYTES_8BIT] = _REFUSED[QuantizationMethod.BITSANDBYTES_4BIT]


def check_format_options(request: LoadRequest, *, built: list[str], passed: list[str]) -> None:
    """Before anything is built: each option names components this load has (quantization: those read from
    the folder; layerwise casting: any module component; pins: those passed in)."""
    quantized_passed = [name for name in passed if _names(request.quantization_config, name)]
    if quantized_passed:
        raise FormatOptionError(
            f"quantization_config names {quantized_passed}, which were passed in: a component passed in is placed "
            "as it is; quantize it yourself (its owner's quantizer) or let the load read it from the folder."
        )
    check_requested_names(request.quantization_config, built + passed)
    modules = built + passed
    unknown = sorted(set(request.layerwise_casting) - set(modules))
    if unknown:
        raise FormatOptionError(
            f"layerwise_casting names {unknown}, which are not module components of this pipeline; its module "
            f"components are {sorted(modules)}."
        )
    stray = sorted(set(request.pin) - set(passed))
    if stray:
        raise FormatOptionError(
            f"pin={list(request.pin)} names {stray}, which were not passed in; pin keeps a component you pass "
            f"(e.g. transformer=my_model) where it is. Passed in: {sorted(passed) or 'nothing'}."
        )


def _names(quantization_config: Any, name: str) -> bool:
    if isinstance(quantization_config, Mapping):
        return name in quantization_config
    if callable(getattr(quantization_config, "_resolve_quant_config", None)):
        return name in (quantization_config.quant_mapping or {}) or name in (
            quantization_config.components_to_quantize or [])
    return False


def load_modules_without_device_map(opened, request: LoadRequest) -> dict[str, nn.Module]:
    """No device_map: each module component loaded to the CPU by its own class (quantized by its owner when the
    request or its folder says so), with layerwise casting applied when asked."""
    loaded = {}
    for name, source in opened.modules.items():
        config = requested_quantization(request.quantization_config, name, source.family)
        module = load_without_device_map(source.cls, source.folder, family=source.family, dtype=opened.dtypes[name],
                                         variant=request.variant, quantization_config=config)
        storage = request.layerwise_casting.get(name)
        if storage is not None:
            compute = opened.dtypes[name] or _floating_dtype(module)
            apply_layerwise_casting(module, casting_config(module, storage, compute))
        loaded[name] = module
    return loaded


def _floating_dtype(module: nn.Module):
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def check_plan_formats(plan: Plan, metas: Mapping[str, MetaComponent]) -> None:
    """A quantized component planned where its format cannot run is an error now, before any weight is read,
    with the numbers and what to do."""
    for name, meta in metas.items():
        quantization = meta.quantization
        component = plan.components.get(name)
        if quantization is None or component is None:
            continue
        why = _REFUSED.get(quantization.method, {}).get(component.kind)
        if why is None:
            continue
        raise FormatPlacementError(
            f"Component {name!r} ({format_label(quantization)}, {format_bytes(component.bytes)}) is planned "
            f"{component.kind.value}, which its format cannot do here: {why}. Give its accelerator room for it "
            f"whole (a larger max_memory, or device_map pinning {name!r} to a GPU), or choose a format that "
            "offloads (torchao or quanto int8 / fp8 layerwise casting)."
        )


def layerwise_label(meta: MetaComponent) -> str:
    """The words a plan adds to a component's dtype when it is stored small by layerwise casting."""
    storage = str(meta.layerwise_casting).removeprefix("torch.")
    compute = str(compute_dtype(meta)).removeprefix("torch.")
    return f"Linear/Conv weights stored {storage} by layerwise casting, computed in {compute}"


__all__ = ["FormatOptionError", "FormatPlacementError", "check_format_options",
           "check_plan_formats", "layerwise_label", "load_modules_without_device_map"]
