"""`pipelines.place(pipe, ...)`: the placement `from_pretrained` gives, for a pipeline the user already built
(e.g. a diffusers pipeline with a quantized transformer), without reloading anything.

The modules are planned as they are (their own dtypes, nothing cast), moved to the plan's devices and given the
hooks of their placement kind; `pipe.hf_device_map` and `pipe.placement_plan` are set as a load would set them.
Components that already carry their own `hf_device_map` (loaded with a device_map) are pinned where they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from hooks.errors import OffloadConflictError
from hooks.layerwise_casting import apply_layerwise_casting, remove_layerwise_casting
from placement.plan_schema import Plan

from ..folder.components import PipelineComponents, module_dtype
from ..hf.diffusers_pipeline import attach_reset
from ..hf.loading_keywords import check_no_keywords_left
from .formats import check_format_options, formats_of_modules
from .layerwise import casting_config
from .pipeline_loader import place_pipeline, plan_components
from .placing import check_plan_devices, check_requested_devices
from .planning import modules_and_edges, passed_pins
from .options import LoadOptions, Scope
from .request import resolve_request


def place(pipe: Any, *, device_map="balanced", max_memory=None, call: Mapping[str, Any] | None = None,
          offload_folder: str | Path | None = None, layerwise_casting: Mapping[str, Any] | None = None,
          pin: Sequence[str] = (), **keywords: Any) -> Plan:
    """Plan `pipe`'s module components as they are, move and dispatch them; returns the plan (also
    `pipe.placement_plan`). `device_map` takes what `from_pretrained` takes (a strategy, a dict, one device, a
    saved plan). Refused on a pipeline that is device-mapped already: call `pipe.reset_device_map()` first.
    Quantized components are planned at their real storage. `layerwise_casting={"transformer":
    torch.float8_e4m3fn}` stores those components' Linear/Conv weights in fp8 first (diffusers' skip patterns),
    so they are planned at that size. `pin=["transformer"]` keeps a component where it is; one whose own
    `hf_device_map` puts weights on an accelerator is kept there anyway. Any other keyword is an error naming the
    closest argument."""
    check_no_keywords_left(keywords, entry=place, label="pipelines.place")
    if getattr(pipe, "hf_device_map", None) is not None:
        raise OffloadConflictError(
            f"{type(pipe).__name__} is device-mapped already (hf_device_map={pipe.hf_device_map}); call "
            "pipe.reset_device_map() before placing it again."
        )
    options = LoadOptions(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder, call=call,
                          progress=False, layerwise_casting=layerwise_casting, pin=pin)
    request = resolve_request(None, options, scope=Scope.PIPELINE)
    check_requested_devices(request.device_map, request.accelerators)
    modules, _ = modules_and_edges(pipe)
    check_format_options(request, built=[], passed=list(modules))
    pins, notes = passed_pins(modules, pin=request.options.pin)  # before casting: its hooks are not a placement
    for name, storage in request.options.layerwise_casting.items():
        module = modules[name]
        apply_layerwise_casting(module, casting_config(module, storage, module_dtype(module)))

    try:
        plan = plan_components(pipe, request, {}, pins=pins, notes=notes, formats=formats_of_modules(modules),
                               passed_origin="as it is, placed by pipelines.place")
        check_plan_devices(plan, request.accelerators)
        place_pipeline(pipe, plan, {}, modules, request)
    except BaseException:
        for name in request.options.layerwise_casting:  # nothing half-done: the casting this call applied comes off
            remove_layerwise_casting(modules[name])
        raise
    if not isinstance(pipe, PipelineComponents):
        attach_reset(pipe)
    return plan
