"""THE technique table: one row (`TechniqueSpec`) per runtime technique, each defined beside its technique.

Read by the conflict check (each row's `refuses`), the pipeline/model `enable_*` methods (`apply_to_each`,
`OFFLOADING`), and the plan dispatcher (`technique_for`: the row that runs a component's placement).

Adding a technique: its file (config, hooks, `apply_x(module, config) -> handle`, `remove_x`, and its row
`SPEC`, which says what it refuses on a tree and what it refuses on top of it), its member of
`techniques.Technique`, and its line below. A row with `plan_kinds`/`serves`/`plan_config` is picked by the
plan dispatcher; no other row changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from placement.plan_schema import ComponentPlan

from .dispatch import SPEC as DEVICE_MAP
from .errors import PlacementRuntimeError
from .group_offload.offload import SPEC as GROUP_OFFLOAD
from .layerwise_casting import SPEC as LAYERWISE_CASTING
from .model_offload import SPEC as MODEL_OFFLOAD
from .residency import SPEC as PER_CALL_RESIDENCY
from .sequential_offload import SPEC as SEQUENTIAL_OFFLOAD
from .techniques import PlanContext, Technique, TechniqueSpec, use_table

TECHNIQUES: Mapping[Technique, TechniqueSpec] = MappingProxyType({spec.technique: spec for spec in (
    DEVICE_MAP,          # whole / split / cpu / disk placements: input-moving hooks, served cpu/disk parts
    MODEL_OFFLOAD,       # whole components to the accelerator when called (enable_model_cpu_offload)
    SEQUENTIAL_OFFLOAD,  # every layer's weights at each forward (enable_sequential_cpu_offload)
    GROUP_OFFLOAD,       # blocks or leaves at each forward, prefetched (enable_group_offload; offloaded plans)
    LAYERWISE_CASTING,   # fp8 storage, upcast per layer (enable_layerwise_casting)
    PER_CALL_RESIDENCY,  # resident / per-call / streamed modules of a plan's transfer model
)})

use_table(TECHNIQUES)  # the conflict check reads the rows of the techniques it finds on a tree

# The techniques whose hooks keep their own copies of the weights: a module under them cannot be .to()-ed.
OFFLOADING = frozenset(technique for technique, spec in TECHNIQUES.items() if spec.offloads_weights)


def technique_for(component: ComponentPlan, context: PlanContext) -> TechniqueSpec:
    """The row that runs `component` as its plan places it (exactly one does)."""
    rows = [spec for spec in TECHNIQUES.values() if spec.runs(component, context)]
    if len(rows) != 1:
        raise PlacementRuntimeError(
            f"{component.name}: {len(rows)} techniques claim its placement ({component.kind.value}, device_map "
            f"{component.device_map}): {[spec.technique.value for spec in rows]}. This is a bug in the technique "
            "table's `serves` rules; please report it."
        )
    return rows[0]


def remove_technique(module: nn.Module, technique: Technique | str) -> None:
    """Remove `technique` (a `Technique` or its value, e.g. "group offloading") from `module`'s tree."""
    TECHNIQUES[Technique(technique)].remove(module)


def apply_to_each(technique: Technique, modules: Mapping[str, nn.Module],
                  config_for: Callable[[str], Any]) -> dict[str, Any]:
    """Apply `technique` to every module with `config_for(name)`; if one fails, the ones done are removed,
    so nothing is left half-done. Returns the handles by name."""
    spec = TECHNIQUES[technique]
    handles: dict[str, Any] = {}
    try:
        for name, module in modules.items():
            handles[name] = spec.apply(module, config_for(name))
    except BaseException:
        for handle in handles.values():
            handle.remove()
        raise
    return handles


__all__ = ["OFFLOADING", "TECHNIQUES", "apply_to_each", "remove_technique", "technique_for"]
