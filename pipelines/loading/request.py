"""One load, resolved once at its entry: the caller's keywords become one frozen `LoadOptions` (each keyword
written once; the entries' signatures are made from its fields), then one `LoadRequest` (the folder after the
Hub, device_map as what it is, dtypes, accelerators), so `plan_placement(folder, **kw)` is the plan
`from_pretrained(folder, **kw)` follows."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from pydantic import ValidationError
from torch import nn

from placement.device_maps import is_single_device
from placement.devices import Accelerators, detect_accelerators
from placement.errors import PlanError
from placement.plan_schema import Plan
from placement.sizes import format_bytes
from placement.sizing import dtype_for, size_module

from ..errors import LoadError
from ..folder.sources import HubOptions, resolve_folder
from ..hf.loading_keywords import (
    chosen_dtype,
    SAFETENSORS_ONLY,
    pickle_opt_in,
    take_foreign_keywords,
    unknown_keyword_error,
)
from ..hf.single_file import is_single_file
from .meta import parse_layerwise_casting


class Scope(str, Enum):
    """What the strategy names mean (`placement.plan(scope=...)`): a pipeline's, or accelerate's for one model.
    Also which keywords an entry takes (`takes`): a model has no components to pass, pin or quantize by name."""

    PIPELINE = "pipeline"
    MODEL = "model"


BOTH = frozenset(Scope)
PIPELINE_ONLY = frozenset({Scope.PIPELINE})
MODEL_ONLY = frozenset({Scope.MODEL})


def _option(default: Any = None, *, takes: frozenset = BOTH) -> Any:
    """A field of `LoadOptions`; `takes`: the scopes whose entries accept it as a keyword."""
    return field(default=default, metadata={"takes": takes})


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Every option of a load or a plan, as the caller gave it, normalised where no folder is needed."""

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
    # Whether the denoiser's guidance branches may run on two GPUs at once (`placement.plan(guidance_parallel=)`):
    # None, the predicted seconds decide; True, wherever it applies (else the plan says why not); False, never.
    guidance_parallel: bool | None = _option(takes=PIPELINE_ONLY)
    # The load's byte bar; a plan reads no weights and draws none (taken so that the same keywords plan).
    progress: bool = _option(True)
    # A folder naming a diffusers class loads as a generic Pipeline instead (each component an attribute).
    generic: bool = _option(False, takes=PIPELINE_ONLY)
    # Lets model_index.json name classes by module path that are then imported (their code runs).
    trust_remote_code: bool = _option(False, takes=PIPELINE_ONLY)
    # diffusers' switch: None/True read safetensors (always here); False only lets a component's owner read its
    # pickle weights in a load without device_map (`pickle_opt_in`).
    use_safetensors: bool | None = _option()
    # The Hub download, as diffusers spells it.
    local_files_only: bool = _option(False)
    revision: str | None = _option()
    token: str | bool | None = _option()
    cache_dir: str | Path | None = _option()
    # Components quantized as they load, by their owner's quantizer (a PipelineQuantizationConfig, or
    # {component: config}); planned at their quantized size.
    quantization_config: Any = _option(takes=PIPELINE_ONLY)
    # {component: fp8 dtype}: Linear/Conv weights stored in it, computed in torch_dtype; planned at stored size.
    layerwise_casting: Mapping[str, torch.dtype] = _option(takes=PIPELINE_ONLY)
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
        """The options among `keywords`, and the keywords left: a pipeline's components passed in (the loader
        checks their names); for a model, nothing, or an error naming the closest argument."""
        arguments = entry.arguments
        own = {name: value for name, value in keywords.items() if name in arguments}
        rest = take_foreign_keywords({name: value for name, value in keywords.items() if name not in arguments},
                                     entry=label)
        if rest and entry.scope is Scope.MODEL:
            raise unknown_keyword_error(rest, entry=label, arguments=arguments)
        return cls(**{**entry.defaults, **own}), rest


def arguments_of(scope: Scope) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(LoadOptions) if scope in f.metadata["takes"])


PIPELINE_ARGUMENTS = arguments_of(Scope.PIPELINE)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """`from_pretrained` (plans=False) or `plan_placement` of a scope."""

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
        """plan_placement plans diffusers' "balanced" for a pipeline, accelerate's "auto" for one model."""
        if not self.plans:
            return {}
        return {"device_map": "balanced" if self.scope is Scope.PIPELINE else "auto"}


PIPELINE_LOAD = Entry(scope=Scope.PIPELINE, plans=False)
PIPELINE_PLAN = Entry(scope=Scope.PIPELINE, plans=True)
MODEL_LOAD = Entry(scope=Scope.MODEL, plans=False)
MODEL_PLAN = Entry(scope=Scope.MODEL, plans=True)


def entry_signature(entry: Entry, *, rest: str | None = None) -> Callable[[Callable], Callable]:
    """Give an entry `f(cls, pretrained, **keywords)` the signature its options make, for help() and editors;
    `rest`: the name of what else it takes by keyword (a pipeline's components)."""
    def decorate(function: Callable) -> Callable:
        parameters = list(inspect.signature(function).parameters.values())
        first, own = parameters[:2], parameters[2:]  # (cls, pretrained), then **keywords only
        if [p.kind for p in own] != [inspect.Parameter.VAR_KEYWORD]:  # a keyword of its own would be hidden
            raise TypeError(f"{function.__qualname__} must take (cls, pretrained, **keywords): its keywords are "
                            "the fields of LoadOptions")
        defaults = {**{f.name: f.default for f in dataclasses.fields(LoadOptions)}, **entry.defaults}
        keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name])
                    for name in entry.arguments]
        tail = [inspect.Parameter(rest, inspect.Parameter.VAR_KEYWORD)] if rest else []
        function.__signature__ = inspect.Signature(first + keywords + tail)
        return function
    return decorate


def saved_plan(device_map: Any) -> Plan | None:
    """The plan `device_map` names, or None; a path (or a string ending in .json) always names a plan file."""
    if isinstance(device_map, Plan):
        return device_map
    if not (isinstance(device_map, Path) or (isinstance(device_map, str) and device_map.endswith(".json"))):
        return None
    path = Path(device_map)
    if not path.is_file():
        raise LoadError(
            f"device_map={str(device_map)!r} looks like a plan file but {path} does not exist; write one with "
            "Path(...).write_text(plan.to_json()) (or `placement plan ... --json plan.json`)."
        )
    try:
        return Plan.from_json(path.read_text())
    except ValidationError as error:
        raise LoadError(f"{path} is not a placement plan (plan.to_json()): {error}") from error


def check_saved_plan(plan: Plan, modules: Mapping[str, nn.Module], torch_dtype) -> Plan:
    """`plan` itself, once its components and byte counts are those of `modules` at `torch_dtype`: a plan
    followed as saved must have been made for these components."""
    planned, present = set(plan.components), set(modules)
    if planned != present:
        raise LoadError(
            f"The plan given as device_map places {sorted(planned)}, but this pipeline's module components are "
            f"{sorted(present)} (missing from the plan: {sorted(present - planned)}, not in the pipeline: "
            f"{sorted(planned - present)}); make the plan from the same folder with plan_placement(...)."
        )
    for name, module in modules.items():
        dtype = dtype_for(torch_dtype, name)
        size = size_module(module, dtype).total
        expected = plan.components[name]
        if size != expected.bytes:
            raise LoadError(
                f"The plan given as device_map sized {name!r} at {format_bytes(expected.bytes)} "
                f"({expected.dtype}), but loaded with torch_dtype={dtype} it takes {format_bytes(size)}; pass the "
                "torch_dtype the plan was made with, or plan again."
            )
    return plan


def nest_flat_device_map(device_map: Any, modules: Mapping[str, nn.Module]) -> Any:
    """A flat map's dotted keys grouped under their component (`{"unet.down_blocks.0": 0}` ->
    `{"unet": {"down_blocks.0": 0}}`); anything else is returned unchanged."""
    if not isinstance(device_map, Mapping):
        return device_map
    nested: dict[str, Any] = {}
    for key, device in device_map.items():
        component, dot, path = str(key).partition(".")
        if not dot or component not in modules:
            if isinstance(nested.get(key), dict):
                raise LoadError(f"device_map places {key!r} whole and also submodules of it: {nested[key]}.")
            nested[key] = device
            continue
        if component in nested and not isinstance(nested[component], dict):
            raise LoadError(
                f"device_map places {component!r} whole ({nested[component]!r}) and also its submodule {path!r}; "
                "give either the component or its submodules."
            )
        nested.setdefault(component, {})[path] = device
    return nested


class DeviceMapKind(Enum):
    NONE = "none"  # no device_map: loaded to the CPU as each class loads itself, no plan, no hooks
    SAVED_PLAN = "saved plan"  # a placement.Plan or the path of its JSON: followed as it is
    PINS = "pins"  # a dict {component | dotted path: device}: pinned as given, the rest planned around it
    STRATEGY = "strategy"  # "balanced", "auto", "sequential", "balanced_low_0" (placement checks the name)
    SINGLE_DEVICE = "single device"  # "cuda", "cuda:1", 0, "cpu", a torch.device: everything there, no hooks


@dataclass(frozen=True, kw_only=True)
class DeviceMapRequest:
    """`device_map` as what it is. `value`: the Plan, the pins dict, the strategy name or the device."""

    kind: DeviceMapKind
    value: Any = None

    @classmethod
    def interpret(cls, device_map: Any) -> "DeviceMapRequest":
        if device_map is None:
            return cls(kind=DeviceMapKind.NONE)
        plan = saved_plan(device_map)  # reads a plan file once; a missing or invalid one is an error here
        if plan is not None:
            return cls(kind=DeviceMapKind.SAVED_PLAN, value=plan)
        if isinstance(device_map, Mapping):
            return cls(kind=DeviceMapKind.PINS, value=MappingProxyType(dict(device_map)))
        if is_single_device(device_map):
            return cls(kind=DeviceMapKind.SINGLE_DEVICE, value=device_map)
        return cls(kind=DeviceMapKind.STRATEGY, value=device_map)

    @property
    def hooks(self) -> bool:
        """A single device needs no hooks: the weights already sit where they run."""
        return self.kind is not DeviceMapKind.SINGLE_DEVICE


@dataclass(frozen=True, kw_only=True)
class DtypeRequest:
    """`torch_dtype` validated once: one dtype (or None), or `{component: dtype}` with an optional "default"."""

    default: torch.dtype | None = None
    named: Mapping[str, torch.dtype | None] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, torch_dtype: Any) -> "DtypeRequest":
        named = {str(key): refuse_storage_only(dtype_for(torch_dtype, key), str(key))
                 for key in (torch_dtype if isinstance(torch_dtype, Mapping) else ()) if key != "default"}
        return cls(default=refuse_storage_only(dtype_for(torch_dtype, "default"), "default"),
                   named=MappingProxyType(named))

    def check_names(self, modules: Iterable[str], *, of: str) -> None:
        """A misspelt key would otherwise be ignored without a word, loading that component in the default."""
        modules = sorted(modules)
        unknown = sorted(key for key in self.named if key not in modules)
        if unknown:
            raise PlanError(
                f"torch_dtype names {unknown}, which are not module components of this {of}; its module "
                f"components are {modules}. Fix the key(s), or use 'default' for every other component."
            )

    def for_component(self, name: str) -> torch.dtype | None:
        return self.named.get(name, self.default)


def refuse_storage_only(dtype: torch.dtype | None, key: str) -> torch.dtype | None:
    """An fp8 torch_dtype would load weights that no layer can multiply with its bf16 inputs ("mat1 and mat2
    must have the same dtype"): fp8 is a storage dtype, given as layerwise casting."""
    if dtype is None or dtype.itemsize > 1:
        return dtype
    component, name = "transformer" if key == "default" else key, str(dtype).removeprefix("torch.")
    raise PlanError(
        f"torch_dtype {'' if key == 'default' else f'[{key!r}] '}= {name} is a "
        "storage dtype: layers cannot compute in it. Store weights in it with layerwise casting and compute in "
        f"bfloat16: torch_dtype=torch.bfloat16, layerwise_casting={{{component!r}: torch.{name}}}."
    )


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """The options, and what they resolve to against the folder and the machine (`folder`: None for
    `pipelines.place`, whose modules are built already)."""

    options: LoadOptions
    folder: Path | None
    hub: HubOptions
    scope: Scope
    device_map: DeviceMapRequest
    dtypes: DtypeRequest
    accelerators: Accelerators
    # A single-file checkpoint read for the components it holds; `folder` is then its pipeline's config folder.
    single_file: Path | None = None
    # use_safetensors=False without device_map: the owner library may read a component's pickle weights.
    allow_pickle: bool = False
    # Whether the folder was given as a local path (False: fetched from the Hub, configs only when planning).
    local: bool = True


def resolve_request(pretrained: str | Path | None, options: LoadOptions, *, scope: Scope,
                    allow_patterns: Sequence[str] | None = None, pickle_patterns: Sequence[str] = ()) -> LoadRequest:
    """The request of a load of `pretrained`: a folder or Hub id (fetched with `allow_patterns`, plus
    `pickle_patterns` on the pickle opt-in), a single-file checkpoint (configs from `options.config`), or None."""
    allow_pickle = scope is Scope.PIPELINE and pickle_opt_in(options.use_safetensors, options.device_map)
    if options.use_safetensors is False and not allow_pickle:
        raise LoadError(f"from_pretrained(use_safetensors=False) is not supported: {SAFETENSORS_ONLY}.")
    hub = HubOptions(revision=options.revision, token=options.token, cache_dir=options.cache_dir,
                     local_files_only=bool(options.local_files_only))
    single_file = None
    if pretrained is not None and is_single_file(pretrained):
        if options.config is None:
            raise LoadError(
                f"{Path(pretrained).name} is a single-file checkpoint: give config= the folder (or Hub id) of its "
                "pipeline's configs (model_index.json and each component's config.json; components the file does "
                "not hold need their weights there too), so that nothing is guessed or fetched unasked."
            )
        single_file, pretrained = Path(pretrained), options.config
    if allow_patterns is not None and allow_pickle:
        allow_patterns = [*allow_patterns, *pickle_patterns]
    folder = None if pretrained is None else resolve_folder(pretrained, allow_patterns=allow_patterns,
                                                              subfolder=options.subfolder, hub=hub)
    device_map = options.device_map
    if scope is Scope.PIPELINE and isinstance(device_map, Mapping) and set(device_map) == {""}:
        device_map = device_map[""]  # accelerate's key for "the whole model": for a pipeline, its one device
    return LoadRequest(options=options, folder=folder, hub=hub, scope=scope,
                       device_map=DeviceMapRequest.interpret(device_map),
                       dtypes=DtypeRequest.parse(options.torch_dtype),
                       accelerators=detect_accelerators(), single_file=single_file, allow_pickle=allow_pickle,
                       local=pretrained is None or Path(pretrained).expanduser().exists())
