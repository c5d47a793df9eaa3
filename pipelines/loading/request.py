"""One load, resolved once at its entry (`from_pretrained` / `plan_placement` of pipelines and models): every
argument turned into what it is before any module is built, then handed down as one frozen `LoadRequest`.

- the options: as the caller gave them (`options.LoadOptions`, each keyword written there once);

- the folder: local, after the Hub download (the download options are fields, never carried implicitly);
- `device_map`: None, a saved plan, pins, a strategy or a single device (`DeviceMapRequest`), decided once;
- `torch_dtype`: validated once (`DtypeRequest`); its keys are checked against the module components in one
  place with one message, and each component's dtype is looked up once;
- the accelerators: detected once per load (`placement.devices.detect_accelerators`), used by the device check
  and by every tensor streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import torch

from placement.device_maps import is_single_device
from placement.devices import Accelerators, detect_accelerators
from placement.errors import PlanError
from placement.sizing import dtype_for

from ..errors import LoadError
from ..folder.sources import HubOptions, resolve_folder
from ..hf.hf_spellings import download_options, pickle_opt_in
from ..hf.single_file import is_single_file
from .options import LoadOptions, Scope
from .saved_plans import saved_plan


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
        """Whether placing attaches the runtime hooks: not for a single device (weights already where they run)."""
        return self.kind is not DeviceMapKind.SINGLE_DEVICE


@dataclass(frozen=True, kw_only=True)
class DtypeRequest:
    """`torch_dtype` validated once: one dtype (or None) for every component, or `{component: dtype}` with an
    optional "default" for the others."""

    default: torch.dtype | None = None
    named: Mapping[str, torch.dtype | None] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, torch_dtype: Any) -> "DtypeRequest":
        """Every value checked (a floating dtype, its name, or None), with placement's message for a bad one;
        an fp8 dtype is refused: nothing computes in it (see `refuse_storage_only`)."""
        if not isinstance(torch_dtype, Mapping):
            return cls(default=refuse_storage_only(dtype_for(torch_dtype, "default"), "default"))
        named = {str(key): refuse_storage_only(dtype_for(torch_dtype, key), str(key))
                 for key in torch_dtype if key != "default"}
        return cls(default=refuse_storage_only(dtype_for(torch_dtype, "default"), "default"),
                   named=MappingProxyType(named))

    def check_names(self, modules: Iterable[str], *, of: str) -> None:
        """A dict may name module components and "default" only: a misspelt key would otherwise be ignored
        without a word, loading that component in the default dtype. `of` names what the components are of."""
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
    component = "transformer" if key == "default" else key
    raise PlanError(
        f"torch_dtype {'' if key == 'default' else f'[{key!r}] '}= {str(dtype).removeprefix('torch.')} is a "
        "storage dtype: layers cannot compute in it. Store weights in it with layerwise casting and compute in "
        f"bfloat16: torch_dtype=torch.bfloat16, layerwise_casting={{{component!r}: torch.{str(dtype).removeprefix('torch.')}}}."
    )


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """Everything one load or plan needs, resolved once: the caller's `options` as given (`LoadOptions`), and
    what they resolve to against the folder and the machine. `folder` is None for `pipelines.place` (modules
    already built: nothing is read)."""

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
    """The request of a load of `pretrained` (a folder or a Hub id, fetched with `allow_patterns` only, and
    `pickle_patterns` too where a pipeline load opts in to pickle weights; None for modules already built; a
    single-file checkpoint, with `options.config` the folder or Hub id of its pipeline's configs)."""
    allow_pickle = scope is Scope.PIPELINE and pickle_opt_in(options.use_safetensors, options.device_map)
    hub = download_options(use_safetensors=None if allow_pickle else options.use_safetensors,
                           revision=options.revision, token=options.token, cache_dir=options.cache_dir,
                           local_files_only=options.local_files_only)
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
