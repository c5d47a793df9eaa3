"""The options of a load, written once: every keyword of `from_pretrained` and `plan_placement` (a pipeline's and
a model's), with its default and why it exists, taken from the caller's keywords in one place.

The two entries of one scope take the same keywords and build the same `LoadOptions`, and both hand the request
made from it to the same planning function (`pipeline_loader.plan_folder_pipeline`; for a model, `model_loader`'s
`_plan`), so `plan_placement(folder, **kw)` is the plan `from_pretrained(folder, **kw)` follows. The one
difference is what a missing `device_map` means: no plan at all for `from_pretrained` (the CPU, as diffusers
loads), the scope's default strategy for `plan_placement` (a plan of nothing would answer nothing). The entries'
signatures, and the arguments a misspelt keyword is matched against, are generated from the fields below
(`entry_signature`, `Entry.arguments`), so a keyword added here is taken by every entry of its scopes at once.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from ..hf.hf_spellings import chosen_dtype
from ..hf.loading_keywords import take_foreign_keywords, unknown_keyword_error
from .layerwise import parse_layerwise_casting


class Scope(str, Enum):
    """What the strategy names mean (`placement.plan(scope=...)`): a pipeline's, or accelerate's for one model.
    Also which keywords an entry takes (`takes`): a model has no components to pass, pin or quantize by name."""

    PIPELINE = "pipeline"
    MODEL = "model"


BOTH = frozenset(Scope)
PIPELINE_ONLY = frozenset({Scope.PIPELINE})
MODEL_ONLY = frozenset({Scope.MODEL})


def _option(default: Any = None, *, takes: frozenset = BOTH, factory: Callable[[], Any] | None = None) -> Any:
    """A field of `LoadOptions`; `takes`: the scopes whose entries accept it as a keyword."""
    if factory is not None:
        return field(default_factory=factory, metadata={"takes": takes})
    return field(default=default, metadata={"takes": takes})


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Every option of a load or a plan, as the caller gave it, after the normalisations that need no folder
    (`dtype` folded into `torch_dtype`, `layerwise_casting` parsed, `pin` a tuple). What needs the folder or the
    machine (`device_map` interpreted, dtype keys checked, accelerators) is resolved by `request.resolve_request`."""

    # Where the weights go: None (the CPU, no plan, as diffusers loads), a strategy name, a dict of pins, one
    # device, or a saved plan. plan_placement defaults to its scope's strategy (`Entry.defaults`).
    device_map: Any = _option()
    # Bytes each device may hold, {0: "24GiB", "cpu": "64GiB"}; None: detected free memory minus a margin.
    max_memory: Mapping | None = _option()
    # The dtype to compute in: one, or {component: dtype, "default": dtype}; None keeps the checkpoint's.
    torch_dtype: Any = _option()
    # diffusers' newer spelling of torch_dtype: folded into it (both only when they agree), then None.
    dtype: Any = _option()
    # The weight files' variant ("fp16": diffusion_pytorch_model.fp16.safetensors).
    variant: str | None = _option()
    # Permits planning onto "disk"; those weights are read from the checkpoint's own files, nothing is written.
    offload_folder: str | Path | None = _option()
    # A model's folder inside a repository (a pipeline's components are found by its model_index.json).
    subfolder: str | None = _option(takes=MODEL_ONLY)
    # What will be called ({"height": 1024, "width": 1024, ...}): activations and runs per call are planned for it.
    call: Mapping[str, Any] | None = _option(takes=PIPELINE_ONLY)
    # The GPU the plan's predicted seconds per call assume ("rtx4090", "h100", or a `GpuProfile`): for a plan
    # made for another machine; None: this machine's GPU, else a stated default (`placement.plan(gpu=)`).
    gpu: Any = _option(takes=PIPELINE_ONLY)
    # The load's byte bar; a plan reads no weights and draws none (taken so that the same keywords plan).
    progress: bool = _option(True)
    # A folder naming a diffusers class loads as a generic Pipeline instead (each component an attribute).
    generic: bool = _option(False, takes=PIPELINE_ONLY)
    # Lets model_index.json name classes by module path that are then imported (their code runs).
    trust_remote_code: bool = _option(False, takes=PIPELINE_ONLY)
    # diffusers' switch: None/True read safetensors (always here); False only lets a component's owner read its
    # pickle weights in a load without device_map (`hf_spellings.pickle_opt_in`).
    use_safetensors: bool | None = _option()
    # The Hub download (`folder.hub.HubOptions`), as diffusers spells it.
    local_files_only: bool = _option(False)
    revision: str | None = _option()
    token: str | bool | None = _option()
    cache_dir: str | Path | None = _option()
    # Components quantized as they load, by their owner's quantizer (a PipelineQuantizationConfig, or
    # {component: config}); planned at their quantized size.
    quantization_config: Any = _option(takes=PIPELINE_ONLY)
    # {component: fp8 dtype}: Linear/Conv weights stored in it, computed in torch_dtype; planned at stored size.
    layerwise_casting: Mapping[str, torch.dtype] = _option(takes=PIPELINE_ONLY,
                                                           factory=lambda: MappingProxyType({}))
    # Components passed in that stay where they are, whatever their own map says.
    pin: tuple[str, ...] = _option((), takes=PIPELINE_ONLY)
    # With a single-file checkpoint as `pretrained`: the folder or Hub id of its pipeline's configs.
    config: str | Path | None = _option(takes=PIPELINE_ONLY)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the normalised values are set once, here
        set_(self, "torch_dtype", chosen_dtype(self.torch_dtype, self.dtype))
        set_(self, "dtype", None)
        set_(self, "layerwise_casting", MappingProxyType(parse_layerwise_casting(self.layerwise_casting or None)))
        set_(self, "pin", tuple(self.pin or ()))

    @classmethod
    def take(cls, keywords: Mapping[str, Any], *, entry: "Entry", label: str) -> tuple["LoadOptions", dict[str, Any]]:
        """The options among `keywords` given to `entry` (called as `label`), and the keywords left: for a
        pipeline, the components passed in (the loader, which knows them, checks their names); for a model,
        nothing, or an error naming the closest argument. diffusers' own loading keywords are accepted or
        refused by name on the way (`hf.loading_keywords`)."""
        arguments = entry.arguments
        own = {name: value for name, value in keywords.items() if name in arguments}
        rest = take_foreign_keywords({name: value for name, value in keywords.items() if name not in arguments},
                                     entry=label)
        if rest and entry.scope is Scope.MODEL:
            raise unknown_keyword_error(rest, entry=label, arguments=arguments)
        return cls(**{**entry.defaults, **own}), rest


def arguments_of(scope: Scope) -> tuple[str, ...]:
    """The keywords the entries of `scope` take, in field order."""
    return tuple(f.name for f in dataclasses.fields(LoadOptions) if scope in f.metadata["takes"])


# What a keyword that is no component of a pipeline may have meant (`hf.loading_keywords.unknown_pipeline_keywords`).
PIPELINE_ARGUMENTS = arguments_of(Scope.PIPELINE)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A Python entry that takes load options: `from_pretrained` (plans=False) or `plan_placement` of a scope."""

    scope: Scope
    plans: bool

    @property
    def arguments(self) -> tuple[str, ...]:
        return arguments_of(self.scope)

    @property
    def method(self) -> str:
        return "plan_placement" if self.plans else "from_pretrained"

    @property
    def defaults(self) -> dict[str, Any]:
        """plan_placement without device_map plans what the scope's anchor does by default: diffusers'
        "balanced" for a pipeline, accelerate's "auto" for one model."""
        if not self.plans:
            return {}
        return {"device_map": "balanced" if self.scope is Scope.PIPELINE else "auto"}


PIPELINE_LOAD = Entry(scope=Scope.PIPELINE, plans=False)
PIPELINE_PLAN = Entry(scope=Scope.PIPELINE, plans=True)
MODEL_LOAD = Entry(scope=Scope.MODEL, plans=False)
MODEL_PLAN = Entry(scope=Scope.MODEL, plans=True)


def entry_signature(entry: Entry, *, rest: str | None = None) -> Callable[[Callable], Callable]:
    """Decorate an entry `f(cls, pretrained, **keywords)` with the signature its options make (`help()`,
    `inspect.signature` and editors show every keyword and default); `rest`: the name of what else it takes by
    keyword (a pipeline's components)."""
    def decorate(function: Callable) -> Callable:
        parameters = list(inspect.signature(function).parameters.values())
        first, own = parameters[:2], parameters[2:]  # (cls, pretrained), then **keywords only
        if [p.kind for p in own] != [inspect.Parameter.VAR_KEYWORD]:  # a keyword of its own would be hidden
            raise TypeError(f"{function.__qualname__} must take (cls, pretrained, **keywords): its keywords are "
                            "the fields of LoadOptions")
        defaults = {**{f.name: _default(f) for f in dataclasses.fields(LoadOptions)}, **entry.defaults}
        keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name])
                    for name in entry.arguments]
        tail = [inspect.Parameter(rest, inspect.Parameter.VAR_KEYWORD)] if rest else []
        function.__signature__ = inspect.Signature(first + keywords + tail)
        return function
    return decorate


def _default(option: dataclasses.Field) -> Any:
    if option.default_factory is not dataclasses.MISSING:
        return None  # layerwise_casting: none unless given
    return option.default


__all__ = ["Entry", "LoadOptions", "MODEL_LOAD", "MODEL_PLAN", "PIPELINE_ARGUMENTS", "PIPELINE_LOAD", "PIPELINE_PLAN",
           "Scope",
           "arguments_of", "entry_signature"]
