"""ModelMixin.from_pretrained / plan_placement: a one-component load through the pipeline's functions.

The model (component name: its class name) is built by `build_component`, planned by `planning.plan_modules` at
model scope (the strategy names keep accelerate's model-level meaning, a dict maps submodule paths) and placed by
`place_component`, with the pipeline's device check and undo.
"""

from __future__ import annotations

import logging
from pathlib import Path

from placement.plan_schema import Plan

from ..checkpoint.files import CLASS_NAME_KEY, CONFIG_NAME, read_config_dict
from ..errors import LoadError
from ..folder.sources import Family, foreign_model_folder
from .meta import MetaComponent, build_component
from .placing import check_plan_devices, check_requested_devices, place_component
from .planning import plan_modules
from .request import DeviceMapKind, LoadRequest

logger = logging.getLogger(__name__)


def plan_model(cls: type, request: LoadRequest) -> Plan:
    """The plan `load_model` would follow; reads config.json and the safetensors headers only."""
    return _plan(_build(cls, request, weights_required=False), request)


def load_model(cls: type, request: LoadRequest):
    """The model of `cls` saved in `request.folder`, every tensor streamed to its planned device (no device_map:
    to the CPU), with the runtime of its placement kind; nothing half-loaded escapes a failure."""
    check_requested_devices(request.device_map, request.accelerators)
    meta = _build(cls, request, weights_required=True)
    if request.device_map.kind is DeviceMapKind.NONE:
        place_component(meta, None, accelerators=request.accelerators, progress=request.options.progress)
        return meta.module.eval()
    plan = _plan(meta, request)
    check_plan_devices(plan, request.accelerators)
    place_component(meta, plan.components[meta.name], accelerators=request.accelerators,
                    hooks=request.device_map.hooks, progress=request.options.progress)
    meta.module.placement_plan = plan
    return meta.module.eval()


def _build(cls: type, request: LoadRequest, *, weights_required: bool) -> MetaComponent:
    name = cls.__name__
    foreign = foreign_model_folder(request.folder, cls)
    if foreign is not None:
        raise LoadError(
            f"{request.folder} holds a {foreign} (saved by its own library), not a {name}: load it with "
            "pipelines.load_model(folder, device_map=...), which returns the folder's own class placed by this "
            "library's planner."
        )
    request.dtypes.check_names([name], of=f"model (a {name})")
    _warn_on_other_class(cls, request.folder)
    return build_component(name, cls, request.folder, family=Family.OWN, dtype=request.dtypes.for_component(name),
                           variant=request.options.variant, weights_required=weights_required)


def _plan(meta: MetaComponent, request: LoadRequest) -> Plan:
    # As for a pipeline (and accelerate), `offload_folder` is what permits planning onto "disk"; nothing is
    # written there: the checkpoint's own safetensors files serve the disk-offloaded weights.
    return plan_modules(None, {meta.name: meta.module}, edges=None, device_map=request.device_map,
                        dtypes={meta.name: meta.dtype}, max_memory=request.options.max_memory,
                        offload_folder=request.options.offload_folder, call=None, pinned={}, scope=request.scope)


def _warn_on_other_class(cls: type, folder: Path) -> None:
    saved = read_config_dict(folder).get(CLASS_NAME_KEY)
    if saved is not None and saved != cls.__name__:
        logger.warning("%s was saved by %s; loading it as %s.", folder / CONFIG_NAME, saved, cls.__name__)
