"""PipelineComponents: the named components, model graph and placement state that loading, saving and the offload
techniques act on (`framework.pipeline.Pipeline` adds the entry points on top, so this module never imports it).

`reset_device_map()` puts back what a placement changed, per component as the loader recorded it: one the load
built goes to the CPU; one passed in goes back to its own device (or, pinned by its owner, stays); each gets
its `hf_device_map` back (absent where it had none: transformers' `save_pretrained` checks only that the
attribute exists) and what the load switched on (VAE tiling) switched off.

Saving writes one subfolder per component into `atomic_folder`'s staging folder, model_index.json last with a
fresh `_save_id`; a placed pipeline saves as it is, every weight read from where it lives (`hooks.gather`).
Entries the save does not write are carried over; the saved variant's old weight files are replaced wholesale."""

from __future__ import annotations

import copy
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import torch
from torch import nn

from hooks import OFFLOADING, OffloadConflictError, group_offloading_session, techniques_on, undispatch
from hooks.gather import offloaded_weights, offloaded_weights_in_state_dict, unserved_placeholders
from hooks.hook_utils import remove_hooks_of_type
from hooks.input_moving import DeliverOutputsHook
from placement.devices import torch_device
from placement.errors import PlacementError, PlanError
from placement.graph import build_graph, execution_order
from placement.plan_schema import Plan
from placement.sizes import parse_size

from ..checkpoint.files import CONFIG_NAME, WeightsNaming
from ..checkpoint.saving import atomic_folder
from ..errors import CheckpointSaveError, FolderError
from .model_index import MODEL_INDEX_NAME, ModelIndex, SAVE_ID_KEY, spec_for
from .families import OwnModel, weights_name_for


_ORIGINS = "_placement_origins"  # where a pipeline keeps its record: set and read only here


class Origin(str, Enum):
    LOADED = "loaded"  # built and read by the load
    PLACED = "placed"  # passed in, moved and hooked by the load
    KEPT = "kept"  # passed in placed by its owner, pinned where it is


@dataclass(frozen=True, kw_only=True)
class ComponentOrigin:
    """One component as it was before the placement (`undo_calls`: methods turning off what the load switched on)."""

    origin: Origin
    module_id: int
    device: torch.device
    had_device_map: bool
    device_map: Any = None
    owner_hooked: bool = False
    undo_calls: tuple[str, ...] = ()


def record_origins(components: Mapping[str, Any], plan: Plan, passed: Mapping[str, Any]) -> dict[str, ComponentOrigin]:
    """Each planned component as it is now; a pinned one passed in with a map of its own is kept where it is."""
    origins = {}
    for name, planned in plan.components.items():
        module = components[name]
        carried = copy.deepcopy(getattr(module, "hf_device_map", None))
        if name not in passed:
            origin, device = Origin.LOADED, torch.device("cpu")
        else:
            origin = Origin.KEPT if planned.pinned and carried else Origin.PLACED
            device = _weights_device(module)
        origins[name] = ComponentOrigin(
            origin=origin, module_id=id(module), device=device, had_device_map=hasattr(module, "hf_device_map"),
            device_map=carried, owner_hooked=any(hasattr(submodule, "_hf_hook") for submodule in module.modules()))
    return origins


def with_undo_calls(origins: Mapping[str, ComponentOrigin],
                    undo: Mapping[str, tuple[str, ...]]) -> dict[str, ComponentOrigin]:
    return {name: replace(origin, undo_calls=(*origin.undo_calls, *undo.get(name, ())))
            for name, origin in origins.items()}


def remember_origins(pipe: Any, origins: Mapping[str, ComponentOrigin]) -> None:
    setattr(pipe, _ORIGINS, dict(origins))


def origins_of(pipe: Any) -> dict[str, ComponentOrigin]:
    return dict(getattr(pipe, _ORIGINS, None) or {})


def restore_components(modules: Mapping[str, nn.Module], origins: Mapping[str, ComponentOrigin]) -> None:
    """Put every module back as its record says; one without a record (never placed by a load, or replaced since)
    loses every hook, goes to the CPU and keeps no device map."""
    for name, module in modules.items():
        origin = origins.get(name)
        if origin is None or origin.module_id != id(module):
            undispatch(module)
            module.to("cpu")
            _restore_device_map(module, None)
            continue
        if origin.origin is Origin.KEPT:
            if origin.owner_hooked:  # the owner's hooks stay; only a hand-over of outputs may be the load's
                remove_hooks_of_type(module, DeliverOutputsHook)
            else:
                undispatch(module)  # only the input-moving hooks the load added: the weights stay
                _restore_device_map(module, origin)
        else:
            undispatch(module)  # every hook, offload ones too; offloaded and disk weights come back
            module.to(origin.device)
            _restore_device_map(module, origin)
        for method in origin.undo_calls:
            getattr(module, method)()


def _restore_device_map(module: nn.Module, origin: ComponentOrigin | None) -> None:
    """The recorded map; without a record none (None on ours: ModelMixin declares the attribute)."""
    if origin is not None and origin.had_device_map:
        module.hf_device_map = copy.deepcopy(origin.device_map)
    elif origin is None and isinstance(module, OwnModel):
        module.hf_device_map = None
    elif "hf_device_map" in vars(module):
        del module.hf_device_map


def _weights_device(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


OFFLOAD_TECHNIQUES = OFFLOADING  # read from the technique table: the rows whose hooks hold their own weights


class PipelineComponents:
    """The state of every pipeline: components, model graph (edges `(producer, consumer)`, those touching a None
    component ignored), hf_device_map and the plan it was loaded with."""

    model_graph: ClassVar[Sequence[tuple[str, str]]] = ()

    def __init__(self) -> None:  # no components of its own: see `is_generic`
        self._component_names: list[str] = []
        self.hf_device_map: dict[str, Any] | None = None
        self.placement_plan = None

    def register_components(self, **named: Any) -> None:
        """Register components (modules, non-modules, or None for an absent optional one) as attributes."""
        for name, component in named.items():
            if name.startswith("_") or not name.isidentifier():
                raise FolderError(f"Component name {name!r} must be a public Python identifier.")
            if name not in self._component_names:
                self._component_names.append(name)
            setattr(self, name, component)

    @property
    def components(self) -> dict[str, Any]:
        """Every registered component by name, in registration order."""
        return {name: getattr(self, name) for name in self._component_names}

    @property
    def module_components(self) -> dict[str, nn.Module]:
        """The nn.Module components, in execution order."""
        components = self.components
        return {name: components[name] for name in self.execution_order}

    @property
    def graph_edges(self) -> list[tuple[str, str]]:
        """The model graph's edges between present module components."""
        components = self.components
        edges = []
        for producer, consumer in self.model_graph:
            for name in (producer, consumer):
                if name not in components:
                    raise FolderError(
                        f"{type(self).__name__}.model_graph names {name!r}, which is not a registered component "
                        f"(registered: {', '.join(components) or 'none'})."
                    )
            if isinstance(components[producer], nn.Module) and isinstance(components[consumer], nn.Module):
                edges.append((producer, consumer))
        return edges

    @property
    def execution_order(self) -> list[str]:
        """Module component names in topological order of the model graph; ties keep registration order."""
        modules = [name for name, obj in self.components.items() if isinstance(obj, nn.Module)]
        try:
            return execution_order(build_graph(modules, self.graph_edges), modules)
        except PlanError as error:
            raise FolderError(f"{type(self).__name__}.model_graph: {error}") from error

    def component_execution_device(self, name: str) -> torch.device:
        """Where component `name` computes: its plan's execution device, an offload hook's, or its weights'."""
        if self.placement_plan is not None and name in self.placement_plan.components:
            return _torch_device(self.placement_plan.components[name].execution_device)
        return module_execution_device(self.components[name])

    @property
    def device(self) -> torch.device:
        """The execution device of the first module component (where a call starts)."""
        order = self.execution_order
        return self.component_execution_device(order[0]) if order else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return module_dtype(*self.module_components.values())

    def to(self, *args, **kwargs) -> "PipelineComponents":
        """`nn.Module.to` for every module component; refused on a device-mapped or offloaded pipeline."""
        self._refuse_if_device_mapped(".to()")
        self._refuse_if_offloaded(".to()")
        # nn.Module.to's own argument parser: exactly what a module's .to accepts.
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for module in self.module_components.values():
            module.to(device=device, dtype=dtype)
        return self

    def reset_device_map(self) -> None:
        """Undo the placement (see the module docstring); then `.to()` and the offload methods work."""
        restore_components(self.module_components, origins_of(self))
        self.hf_device_map = None
        self.placement_plan = None

    def _refuse_if_device_mapped(self, operation: str) -> None:
        if self.hf_device_map is not None:
            raise OffloadConflictError(
                f"{operation} on a device-mapped {type(self).__name__} (hf_device_map={self.hf_device_map}) "
                "would break its placement; call pipe.reset_device_map() first."
            )

    def _refuse_if_offloaded(self, operation: str) -> None:
        """Offload hooks keep their own copies of the weights: moving the module under them splits the two."""
        on = {name: sorted(t.value for t in techniques_on(module) if t in OFFLOAD_TECHNIQUES)
              for name, module in self.module_components.items()}
        on = {name: found for name, found in on.items() if found}
        if on:
            listed = ", ".join(f"{name} ({', '.join(found)})" for name, found in on.items())
            raise OffloadConflictError(
                f"{operation} on {type(self).__name__} while offloading is on: {listed}. The offload hooks hold "
                "their own copies of the weights; call pipe.reset_device_map() to remove them, then .to(...), "
                "then enable offloading again."
            )

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for name, component in self.components.items():
            lines.append(f"  {name}: {type(component).__name__ if component is not None else None}")
        lines.append(f"  hf_device_map={self.hf_device_map}")
        return "\n".join(lines) + "\n)"


def module_execution_device(module: Any) -> torch.device:
    """Where an offloaded module computes (group offload's onload device, a hook's execution device), else its
    first weight's device."""
    if not isinstance(module, nn.Module):
        return torch.device("cpu")
    session = group_offloading_session(module)
    if session is not None:
        return session.onload_device
    for submodule in module.modules():
        hook = getattr(submodule, "_hf_hook", None)
        for candidate in (hook, *getattr(hook, "hooks", ())):  # a hook, or the hooks of a SequentialHook
            device = getattr(candidate, "execution_device", None)
            if device is not None:
                return _torch_device(device) if isinstance(device, int) else torch.device(device)
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def module_dtype(*modules: nn.Module) -> torch.dtype:
    """The dtype of the first floating parameter (float32 if none); fp8 ones are storage only, never computed in."""
    floats = (tensor.dtype for module in modules for tensor in module.parameters()
              if tensor.is_floating_point() and tensor.dtype.itemsize > 1)
    return next(floats, torch.float32)


def _torch_device(device) -> torch.device:
    return torch_device("cpu" if device == "disk" else device)


def is_generic(cls: type) -> bool:
    """A pipeline class without a constructor of its own (`pipelines.Pipeline`): every folder component an attribute."""
    return cls.__init__ is PipelineComponents.__init__


FORMAT_VERSION = "1"


def save_pipeline(pipe: PipelineComponents, target: Path, *, max_shard_size: int | str, variant: str | None) -> None:
    shard_bytes = parse_size(max_shard_size)
    components = pipe.components
    index = ModelIndex(
        class_name=type(pipe).__name__,
        components={name: spec_for(obj) for name, obj in components.items()},
        model_graph=[tuple(edge) for edge in pipe.model_graph],
        metadata={"_pipeline_placement_format": FORMAT_VERSION, SAVE_ID_KEY: uuid.uuid4().hex},
    )
    rewrites = rewritten_entries(components, variant)
    with atomic_folder(target, rewrites=rewrites) as staging:
        for name, obj in components.items():
            if obj is not None:
                _save_component(name, obj, staging / name, shard_bytes=shard_bytes, variant=variant)
        index.write(staging)


def rewritten_entries(components: dict[str, Any], variant: str | None) -> Callable[[str], bool]:
    """Old entries this save replaces even where it writes no file of that name: model_index.json, and per module
    component its config and every weight file of the saved variant."""
    namings = {name: WeightsNaming(weights_name=_weights_name(obj), variant=variant)
               for name, obj in components.items() if isinstance(obj, nn.Module)}

    def rewrites(path: str) -> bool:
        if path == MODEL_INDEX_NAME:
            return True
        component, _, file_name = path.partition("/")
        naming = namings.get(component)
        return naming is not None and "/" not in file_name and (file_name == CONFIG_NAME or naming.owns(file_name))

    return rewrites


def _weights_name(module: nn.Module) -> str:
    try:
        return weights_name_for(type(module))
    except PlacementError:  # a module class we cannot build: its own save_pretrained names its files
        return getattr(module, "weights_name", "")


def _save_component(name: str, obj: Any, folder: Path, *, shard_bytes: int, variant: str | None) -> None:
    save = getattr(obj, "save_pretrained", None)
    if save is None:
        raise CheckpointSaveError(
            f"Component {name!r} ({type(obj).__name__}) has no save_pretrained(folder) method, so it cannot be "
            "saved; give its class save_pretrained/from_pretrained or register it as None."
        )
    if isinstance(obj, OwnModel):
        save(folder, max_shard_size=shard_bytes, variant=variant)  # reads offloaded weights shard by shard
    elif isinstance(obj, nn.Module):
        with saving_placed(name, obj):
            save(folder, max_shard_size=shard_bytes, variant=variant)
    else:
        save(folder)


@contextmanager
def saving_placed(name: str, module: nn.Module) -> Iterator[None]:
    """While a diffusers or transformers model's `save_pretrained` runs, its `state_dict()` holds its offloaded
    weights (all at once: those writers take the whole state dict), without transformers' warning about them."""
    unserved = unserved_placeholders(module, offloaded_weights(module))
    if unserved:
        raise CheckpointSaveError(
            f"Component {name!r} has {len(unserved)} weights that were never loaded (e.g. {unserved[0]!r}: on the "
            "meta device, and no offload hook or store holds them); load them before saving."
        )
    with offloaded_weights_in_state_dict(module):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
            yield
