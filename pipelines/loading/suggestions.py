"""The single change to one component (fp8 layerwise casting, torchao int8, nf4) that would make a pipeline fit,
or move the fewest bytes: each candidate built on a copy of the meta module as a load would build it and the
whole pipeline re-planned, never guessed."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

import placement
from placement.devices import device_label
from placement.errors import PlacementError
from placement.plan_schema import Plan, VerdictKind
from placement.sizes import format_bytes

from ..hf.quantizers import (
    ComponentQuantization, QuantizationMethod, materialize_on_meta, owner_quantizer,
    quantized_parameter_names,
)
from .meta import MetaComponent, cast_floating_meta, cast_tensor_names, casting_config, compute_dtype

_RANK = {VerdictKind.FITS: 0, VerdictKind.OFFLOADED: 1, VerdictKind.PARTLY_CPU: 2, VerdictKind.NO_FIT: 3}
MAX_COMPONENTS = 2  # the largest components are the ones whose storage changes the outcome


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One single change: component `component` stored as `label`, its meta module built by `build`."""

    component: str
    label: str
    build: Callable[[], nn.Module]


@dataclass(frozen=True, kw_only=True)
class Replanning:
    """What `placement.plan` was called with, to call it again with one component changed."""

    modules: Mapping[str, nn.Module]
    arguments: Mapping[str, Any]  # max_memory, strategy, graph, dtype, offload_folder, scope, ...


def suggestions(plan: Plan | None, metas: Mapping[str, MetaComponent], replanning: Replanning) -> list[str]:
    """One line per single change that does better than `plan` (None: the plan did not fit at all): bfloat16 for
    a plan made in float32 (`bf16_suggestion`), then each component's storage."""
    if plan is not None and plan.verdict.kind is VerdictKind.FITS and not _moved(plan):
        return []
    return bf16_suggestion(plan, metas, replanning) + _storage_suggestions(plan, metas, replanning)


BF16_SUGGESTION = "Suggestion: this plan is in float32; in bfloat16 (torch_dtype=torch.bfloat16, half the bytes) it"


def bf16_suggestion(plan: Plan | None, metas: Mapping[str, MetaComponent], replanning: Replanning) -> list[str]:
    """The plan again with the components held in float32 (no torch_dtype asked, or float32) at bfloat16, said
    when that does better: loading in fp32 by default is the commonest reason a pipeline offloads or fails."""
    in_fp32 = [name for name, meta in metas.items() if meta.quantization is None and meta.layerwise_casting is None
               and meta.dtype in (None, torch.float32) and _holds_float32(meta.module)]
    if not in_fp32:
        return []
    dtype = replanning.arguments.get("dtype")
    dtypes = dict(dtype) if isinstance(dtype, Mapping) else {name: dtype for name in replanning.modules}
    try:
        other = placement.plan(replanning.modules, **{**replanning.arguments,
                                                      "dtype": {**dtypes, **dict.fromkeys(in_fp32, torch.bfloat16)}})
    except PlacementError:
        return []
    if not _better(other, plan):
        return []
    return [f"{BF16_SUGGESTION} {other.verdict.headline.removeprefix('Verdict: ')}"]


def _holds_float32(module: nn.Module) -> bool:
    return any(parameter.dtype == torch.float32 for parameter in module.parameters())


def _storage_suggestions(plan: Plan | None, metas: Mapping[str, MetaComponent], replanning: Replanning) -> list[str]:
    best: dict[str, tuple[Candidate, Plan]] = {}  # per component: its least lossy change with the best outcome
    for candidate in candidates(metas):
        current = best.get(candidate.component)
        if current is not None and _cannot_be_beaten(current[1]):
            continue  # a more lossy change of the same component cannot do better: spare its build
        changed = {**replanning.modules, candidate.component: candidate.build()}
        try:
            other = placement.plan(changed, **_sized_as_built(replanning.arguments, candidate.component))
        except PlacementError:
            continue
        if _better(other, plan) and (current is None or _better(other, current[1])):
            best[candidate.component] = (candidate, other)
    return [_describe(candidate, other) for candidate, other in best.values()]


def _sized_as_built(arguments: Mapping[str, Any], component: str) -> dict[str, Any]:
    """The plan's arguments with `component` sized as its copy holds it (fp8 storage is not a torch_dtype)."""
    dtype = arguments.get("dtype")
    if not isinstance(dtype, Mapping):
        dtype = {name: dtype for name in ("default",)} if dtype is not None else {}
    return {**arguments, "dtype": {**dtype, component: None}}


def candidates(metas: Mapping[str, MetaComponent]) -> list[Candidate]:
    """The candidate changes of the largest components still stored at full precision, smallest change first."""
    eligible = [meta for meta in metas.values() if meta.quantization is None and meta.layerwise_casting is None]
    largest = sorted(eligible, key=lambda meta: -_bytes(meta.module))[:MAX_COMPONENTS]
    found = []
    for meta in largest:
        found.append(Candidate(component=meta.name, label="fp8 layerwise casting",
                               build=lambda meta=meta: _layerwise_copy(meta)))
        if not any(isinstance(layer, nn.Linear) for layer in meta.module.modules()):
            continue  # the quantizers replace Linear layers only (a VAE's convolutions stay as they are)
        if meta.family.quantizable and importlib.util.find_spec("torchao") is not None:
            found.append(Candidate(component=meta.name, label="int8 weight-only (torchao)",
                                   build=lambda meta=meta: _quantized_copy(meta, _torchao_int8(meta))))
        if meta.family.quantizable and importlib.util.find_spec("bitsandbytes") is not None:
            found.append(Candidate(component=meta.name, label="nf4 (bitsandbytes)",
                                   build=lambda meta=meta: _quantized_copy(meta, _nf4(meta))))
    return found


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters())


def _layerwise_copy(meta: MetaComponent) -> nn.Module:
    """A copy sized as `layerwise.with_layerwise_casting` sizes the component (the others in the compute dtype)."""
    copied = copy.deepcopy(meta.module)
    cast_floating_meta(copied, meta.dtype, keep_in_fp32=meta.keep_in_fp32)
    storage = torch.float8_e4m3fn
    for name in cast_tensor_names(copied, casting_config(copied, storage, compute_dtype(meta))):
        set_module_tensor_to_device(copied, name, "meta", dtype=storage)
    return copied


def _quantized_copy(meta: MetaComponent, quantization: ComponentQuantization) -> nn.Module:
    module = copy.deepcopy(meta.module)
    quantizer = owner_quantizer(quantization, meta.family, name=meta.name)
    meta.family.prepare_on_meta(module, quantizer, dtype=compute_dtype(meta), keep_in_fp32=list(meta.keep_in_fp32),
                                checkpoint_files=None)
    materialize_on_meta(module, quantization, quantized_parameter_names(module, quantizer, meta.family))
    return module


def _nf4(meta: MetaComponent) -> ComponentQuantization:
    config = meta.family.library().BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=compute_dtype(meta))
    return ComponentQuantization(config=config, pre_quantized=False, method=QuantizationMethod.BITSANDBYTES_4BIT)


def _torchao_int8(meta: MetaComponent) -> ComponentQuantization:
    from torchao.quantization import Int8WeightOnlyConfig
    config = meta.family.library().TorchAoConfig(Int8WeightOnlyConfig())
    return ComponentQuantization(config=config, pre_quantized=False, method=QuantizationMethod.TORCHAO)


def _cannot_be_beaten(plan: Plan) -> bool:
    return plan.verdict.kind is VerdictKind.FITS and not _moved(plan)


def _moved(plan: Plan) -> int:
    return getattr(plan, "transfer_bytes_per_call", 0) or 0


def _better(other: Plan, plan: Plan | None) -> bool:
    if plan is None:
        return True
    if _RANK[other.verdict.kind] != _RANK[plan.verdict.kind]:
        return _RANK[other.verdict.kind] < _RANK[plan.verdict.kind]
    return _moved(other) < _moved(plan)


def _describe(candidate: Candidate, other: Plan) -> str:
    component = other.components[candidate.component]
    size = format_bytes(component.bytes)
    where = sorted({device_label(d) for c in other.components.values() for d in c.devices})
    if other.verdict.kind is VerdictKind.FITS:
        outcome = f"everything fits on {', '.join(where)}"
    else:
        outcome = f"{other.verdict.kind.value}"
    moved = other.transfer_bytes_per_call
    # "moves 0 B" says nothing: a plan that keeps everything resident just fits.
    moves = f", moves {format_bytes(moved)} per call" if moved else ""
    return f"Suggestion: with {candidate.component} in {candidate.label} ({size}) {outcome}{moves}."


__all__ = ["BF16_SUGGESTION", "Candidate", "Replanning", "bf16_suggestion", "candidates", "suggestions"]
