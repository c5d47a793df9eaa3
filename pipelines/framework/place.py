"""`pipelines.place(pipe, ...)`: the placement `from_pretrained` gives, for a pipeline the user already built
(e.g. a diffusers pipeline with a quantized transformer), without reloading anything.

The modules are planned as they are (their own dtypes, nothing cast), moved to the plan's devices and given the
hooks of their placement kind; `pipe.hf_device_map` and `pipe.placement_plan` are set as a load would set them.
Components that already carry their own `hf_device_map` (loaded with a device_map) are pinned where they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from placement.plan_schema import Plan

from ..errors import DeviceMappedError
from .components import PipelineComponents
from .diffusers_pipeline import attach_reset
from .loading import LoadOptions, check_devices_exist, materialize
from .planning import label_dtypes, modules_and_edges, passed_pins, plan_pipeline


def place(pipe: Any, *, device_map="balanced", max_memory=None, call: Mapping[str, Any] | None = None,
          offload_folder: str | Path | None = None) -> Plan:
    """Plan `pipe`'s module components as they are, move and dispatch them; returns the plan (also
    `pipe.placement_plan`). `device_map` takes what `from_pretrained` takes (a strategy, a dict, one device, a
    saved plan). Refused on a pipeline that is device-mapped already: call `pipe.reset_device_map()` first."""
    if getattr(pipe, "hf_device_map", None) is not None:
        raise DeviceMappedError(
            f"{type(pipe).__name__} is device-mapped already (hf_device_map={pipe.hf_device_map}); call "
            "pipe.reset_device_map() before placing it again."
        )
    modules, edges = modules_and_edges(pipe)
    options = LoadOptions(device_map=device_map, max_memory=max_memory, torch_dtype=None, variant=None,
                          offload_folder=offload_folder, call=call, progress=False)
    plan = plan_pipeline(pipe, device_map=device_map, max_memory=max_memory, torch_dtype=None,
                         offload_folder=offload_folder, call=call, pinned=passed_pins(modules), modules=modules,
                         edges=edges)
    plan = label_dtypes(plan, modules, None, {name: "as it is, placed by pipelines.place" for name in modules})
    check_devices_exist(plan)
    materialize(pipe, plan, {}, modules, options)
    if not isinstance(pipe, PipelineComponents):
        attach_reset(pipe)
    return plan
