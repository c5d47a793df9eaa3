"""What a placement changed on each module component, so that `reset_device_map()` puts back what was there.

The loader records each component just before placing it (`record_origins`) and keeps the record on the pipeline
(`remember_origins`); reset restores it (`restore_components`), for our pipelines and diffusers' classes alike:
- a component the load built (`LOADED`): its hooks removed, its weights on the CPU, and its `hf_device_map` as
  it was built: absent on diffusers and transformers models (transformers' `save_pretrained` checks only that
  the attribute exists, so None would break it), None on ours (a `ModelMixin` declares it);
- a component passed in and placed by the load (`PLACED`): its hooks removed, its weights back on the device
  they came on, its `hf_device_map` as it carried it (or none);
- a component passed in placed by its owner and pinned where it is (`KEPT`): its weights never moved, so they
  stay; the input-moving hooks the load gave it are removed and its own map put back; one that came with its
  owner's hooks was not touched by the load, and reset leaves it as it is too.
Every kind also gets back what the load switched on in it (`undo_calls`: VAE tiling or slicing the plan turned
on, undone by `disable_tiling()` / `disable_slicing()`). So a component passed in is pinned again by the next load, and every model saves with its own `save_pretrained`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Mapping

import torch
from torch import nn

from hooks import undispatch
from hooks.hook_utils import remove_hooks_of_type
from hooks.input_moving import DeliverOutputsHook
from placement.plan_schema import Plan

from .component_classes import OwnModel

_ORIGINS = "_placement_origins"  # where a pipeline keeps its record: set and read only here


class Origin(str, Enum):
    LOADED = "loaded"  # built and read by the load
    PLACED = "placed"  # passed in, moved and hooked by the load
    KEPT = "kept"  # passed in placed by its owner, pinned where it is


@dataclass(frozen=True, kw_only=True)
class ComponentOrigin:
    """One component as it was before the placement. `device`: where its weights go back to; `device_map`: the
    `hf_device_map` it carried (`had_device_map` False: it had none at all); `owner_hooked`: it came with its
    owner's hooks (then the load did not touch it); `module_id`: which object this record is about;
    `undo_calls`: methods of the module that turn off what the load switched on (`disable_tiling`)."""

    origin: Origin
    module_id: int
    device: torch.device
    had_device_map: bool
    device_map: Any = None
    owner_hooked: bool = False
    undo_calls: tuple[str, ...] = ()


def record_origins(components: Mapping[str, Any], plan: Plan, passed: Mapping[str, Any]) -> dict[str, ComponentOrigin]:
    """Each planned component as it is now, before `plan` is carried out; `passed`: the components the caller
    gave (a pinned one with a map of its own is kept where it is, as the loader does)."""
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
    """The records with the methods that turn off what the load switched on in each component."""
    return {name: replace(origin, undo_calls=(*origin.undo_calls, *undo.get(name, ())))
            for name, origin in origins.items()}


def remember_origins(pipe: Any, origins: Mapping[str, ComponentOrigin]) -> None:
    """Keep the record on the pipeline (ours or a diffusers one) until the next placement replaces it."""
    setattr(pipe, _ORIGINS, dict(origins))


def origins_of(pipe: Any) -> dict[str, ComponentOrigin]:
    return dict(getattr(pipe, _ORIGINS, None) or {})


def restore_components(modules: Mapping[str, nn.Module], origins: Mapping[str, ComponentOrigin]) -> None:
    """Put every module back as its record says (see the module docstring). A module without a record (the
    pipeline was never placed by a load, or the component was replaced since) loses every hook, goes to the CPU
    and keeps no device map."""
    for name, module in modules.items():
        origin = origins.get(name)
        if origin is None or origin.module_id != id(module):
            undispatch(module)
            module.to("cpu")
            _clear_device_map(module)
        elif origin.origin is Origin.KEPT:
            if origin.owner_hooked:  # the owner's hooks stay; only a hand-over of outputs may be the load's
                remove_hooks_of_type(module, DeliverOutputsHook)
            else:
                undispatch(module)  # only the input-moving hooks the load added: the weights stay
                _restore_device_map(module, origin)
        else:
            undispatch(module)  # every hook, offload ones too; offloaded and disk weights come back
            module.to(origin.device)
            _restore_device_map(module, origin)
        if origin is not None and origin.module_id == id(module):
            for method in origin.undo_calls:
                getattr(module, method)()


def _restore_device_map(module: nn.Module, origin: ComponentOrigin) -> None:
    if origin.had_device_map:
        module.hf_device_map = copy.deepcopy(origin.device_map)
    elif "hf_device_map" in vars(module):
        del module.hf_device_map


def _clear_device_map(module: nn.Module) -> None:
    if isinstance(module, OwnModel):
        module.hf_device_map = None  # declared by ModelMixin: None means "not device-mapped"
    elif "hf_device_map" in vars(module):
        del module.hf_device_map


def _weights_device(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


__all__ = ["ComponentOrigin", "Origin", "origins_of", "record_origins", "remember_origins", "restore_components",
           "with_undo_calls"]
