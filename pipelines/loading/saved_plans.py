"""Plans round-trip: `device_map=` may be a `placement.Plan`, the path of a plan's JSON (`plan.to_json()`), or
the flat `plan.device_map` / `pipe.hf_device_map` with dotted keys; each reproduces the placement it describes.

A saved plan is followed as it is (plan on a laptop, load that plan on the server): every component it places
and every byte count must match the components being loaded, or the plan was made for something else (another
folder, another torch_dtype) and following it would put the wrong sizes on the devices. A flat map is turned
back into the dict strategy it expresses, `{component: device | {submodule: device}}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError
from torch import nn

from placement.plan_schema import Plan
from placement.sizes import format_bytes
from placement.sizing import dtype_for, size_module

from ..errors import LoadError


def is_plan_path(device_map: Any) -> bool:
    """A path (or a string ending in .json) names a saved plan; strategy and device names never do."""
    return isinstance(device_map, Path) or (isinstance(device_map, str) and device_map.endswith(".json"))


def saved_plan(device_map: Any) -> Plan | None:
    """The plan `device_map` names (a Plan, or the path of its JSON), or None when it is not a saved plan."""
    if isinstance(device_map, Plan):
        return device_map
    if not is_plan_path(device_map):
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
    """`plan` itself, once its components and byte counts are those of `modules` at `torch_dtype`."""
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
