"""Apply a plan's placements to loaded modules: each component gets the runtime of its technique-table row.

The loader has already put every weight where the plan says (accelerator, CPU RAM, or left on meta for
disk). This attaches the runtime that makes each module run there, as the row that serves its placement
says (`technique_table.technique_for`):
- whole / split / cpu / disk, and offloaded with part of its weights resident (a model-level map, as
  accelerate's "auto" makes): a device map (`dispatch`): one input-moving hook at the top of a component placed
  whole, one per device-map entry of a split one, weight-serving hooks on the "cpu"/"disk" parts;
- offloaded on an accelerator with all weights in CPU RAM: block-level group offloading (a whole block per
  transfer, prefetched on a side CUDA stream from pinned memory) rather than accelerate's per-leaf streaming;
  its outputs go back to the caller's device too (`ReturnOutputsHook`), as for every other kind;
- a component with a transfer plan (`ComponentPlan.transfer` listing per-call or streamed modules, or one that
  runs where another loads modules per call): per-call residency, with one coordinator per accelerator shared
  by the components of the pipeline (`apply_plan`).
A plan whose components have no transfer plan (older plans, or everything resident) runs exactly as before
transfer plans existed. Accelerator indices become torch devices through `placement.devices.torch_device`
(virtual ones: `vgpu:k`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from placement.plan_schema import ComponentPlan, Plan

from .dispatch import DiskWeights
from .errors import PlacementRuntimeError
from .hook_utils import add_hook_first
from .input_moving import ReturnOutputsHook
from .technique_table import technique_for
from .techniques import PlanContext, Technique


def apply_component_plan(module: nn.Module, component: ComponentPlan, *, disk_weights: DiskWeights | None = None,
                         context: PlanContext | None = None) -> Any:
    """Attach the hooks that run `module` as `component` places it; sets `module.hf_device_map`. Returns the
    technique's handle (`handle.remove()`; `hooks.dispatch.undispatch(module)` removes them all too).

    `context` carries what the components of one pipeline share (`apply_plan` makes it); without one the
    component is applied alone. If applying fails, nothing is left on the module."""
    context = PlanContext(disk_weights=disk_weights) if context is None else _with_disk_weights(context, disk_weights)
    spec = technique_for(component, context)
    try:
        handle = spec.apply(module, spec.plan_config(component, context))
        if spec.technique is Technique.GROUP_OFFLOAD:
            # Outputs back where the inputs came from, as for the other placement kinds: a pipeline that joins
            # an offloaded encoder's output with a whole one's (SD3's pooled embeddings) gets both on one device.
            add_hook_first(module, ReturnOutputsHook())
    except BaseException:
        spec.remove(module)
        raise
    if getattr(module, "hf_device_map", None) is None:
        module.hf_device_map = dict(component.device_map)
    return handle


@dataclass(frozen=True, kw_only=True, eq=False)
class PlacedModules:
    """The handle of `apply_plan`: each component's technique handle, and `remove()` for all of them."""

    handles: Mapping[str, Any]
    context: PlanContext

    def remove(self) -> None:
        for handle in reversed(list(self.handles.values())):
            handle.remove()


def apply_plan(modules: Mapping[str, nn.Module], plan: Plan, *,
               disk_weights: Mapping[str, DiskWeights | None] | None = None,
               placed_by_owner: Collection[str] = ()) -> PlacedModules:
    """Attach the runtime of every component of `plan` to `modules` (the loaded components, by name), with
    the state the components share (one per-call coordinator per accelerator). `disk_weights`: each
    component's offload index for its "disk" weights. `placed_by_owner`: planned components the caller runs
    otherwise (pinned where their owner placed them); they get nothing here. If one component fails, those
    already done are undone."""
    skipped = set(placed_by_owner)
    missing = [name for name in plan.components if name not in modules and name not in skipped]
    if missing:
        raise PlacementRuntimeError(
            f"The plan places {missing}, which are not among the modules given ({sorted(modules)}); pass every "
            "planned component."
        )
    context = PlanContext(plan=plan)
    handles: dict[str, Any] = {}
    try:
        for name, component in plan.components.items():
            if name in skipped:
                continue
            weights = (disk_weights or {}).get(name)
            handles[name] = apply_component_plan(modules[name], component, disk_weights=weights, context=context)
    except BaseException:
        PlacedModules(handles=handles, context=context).remove()
        raise
    return PlacedModules(handles=handles, context=context)


def _with_disk_weights(context: PlanContext, disk_weights: DiskWeights | None) -> PlanContext:
    return PlanContext(plan=context.plan, disk_weights=disk_weights, shared=context.shared)


__all__ = ["PlacedModules", "apply_component_plan", "apply_plan"]
