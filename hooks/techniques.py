"""The vocabulary of runtime techniques: what a row of the technique table says, and the conflict check.

Every technique is one file holding its config, its hooks, `apply_x(module, config) -> handle` (the handle's
`.remove()` undoes it) and its row, a `TechniqueSpec`: config class, apply, remove, what it refuses and why,
whether it offloads weights, and which placements of a plan it serves. `technique_table.TECHNIQUES` lists
the rows; the conflict check, the pipeline/model `enable_*` methods and the plan dispatcher read them.

Two techniques fighting over the same weights (group offloading on top of accelerate's own offloading,
sequential offload over layerwise casting, ...) would silently waste memory or compute in the wrong dtype, so
applying a technique first calls `check_compatible(module, ITS_ROW)`, which finds the techniques already on
the tree and raises `OffloadConflictError` for any its row refuses, saying where the other one sits.

Our hook classes name their technique in a `technique` class attribute; accelerate's own hooks are recognised
by type (`CpuOffload`: model offload; `AlignDevicesHook` that offloads or only moves inputs: sequential offload;
one with an execution device: a device map). This file imports no technique, so none imports another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from accelerate.hooks import AlignDevicesHook, CpuOffload, ModelHook
from torch import nn

from placement.devices import is_accelerator
from placement.plan_schema import ComponentPlan, Plan, PlacementKind

from .errors import OffloadConflictError
from .hook_utils import hooks_of


class Technique(str, Enum):
    DEVICE_MAP = "a device map"
    MODEL_OFFLOAD = "model offload"
    SEQUENTIAL_OFFLOAD = "sequential offload"
    GROUP_OFFLOAD = "group offloading"
    LAYERWISE_CASTING = "layerwise casting"
    PER_CALL_RESIDENCY = "per-call residency"


@dataclass(kw_only=True)
class PlanContext:
    """What the plan dispatcher hands a row besides the component: the whole plan (None for a component
    applied alone), the checkpoint files serving its "disk" weights, and `shared`, where a row keeps state
    that the components of one pipeline share (per-call residency's per-device coordinators)."""

    plan: Plan | None = None
    disk_weights: Mapping[str, Mapping[str, str]] | None = None
    shared: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TechniqueSpec:
    """One row of the technique table (see the module docstring)."""

    technique: Technique
    config_class: type
    apply: Callable[..., Any]  # apply(module, config) -> a handle with .remove()
    remove: Callable[[nn.Module], None]  # removes the technique from a module's tree, whoever applied it
    # The techniques already on a tree that applying this one refuses -> why ("" = they would fight over weights),
    # and those refused when applied after this one (so a new technique declares both sides in its own row).
    refuses: Mapping[Technique, str] = field(default_factory=dict)
    refused_after: Mapping[Technique, str] = field(default_factory=dict)
    offloads_weights: bool = False  # weights live off the execution device between uses (not .to()-able)
    plan_kinds: frozenset[PlacementKind] = frozenset()  # placements of a plan it may run
    # Among those, whether it runs this one (None: every one of `plan_kinds`).
    serves: Callable[[ComponentPlan, PlanContext], bool] | None = None
    # The config that runs a component as the plan places it (None: not used by plans).
    plan_config: Callable[[ComponentPlan, PlanContext], Any] | None = None

    def runs(self, component: ComponentPlan, context: PlanContext) -> bool:
        if component.kind not in self.plan_kinds or self.plan_config is None:
            return False
        return self.serves is None or self.serves(component, context)


@dataclass(frozen=True, kw_only=True, eq=False)
class Handle:
    """What `apply_x(module, config)` returns: the module, the config as resolved, the runtime state the
    technique keeps (a group offload session, a residency phase; None when it keeps none), and `remove()`."""

    technique: Technique
    module: nn.Module
    config: Any
    remover: Callable[[nn.Module], None] = field(repr=False)
    state: Any = None

    def remove(self) -> None:
        self.remover(self.module)


def follows_transfer_plan(component: ComponentPlan, context: PlanContext) -> bool:
    """The component runs by its transfer plan (per-call residency): it executes on an accelerator and lists
    per-call or streamed modules, or uses an accelerator (executes there or holds resident parts there) where
    another component loads modules per call (whose room its runs may need). Components without a transfer
    plan (older plans) never do."""
    transfer = component.transfer
    if transfer is None or not is_accelerator(component.execution_device):
        return False
    if transfer.per_call_modules or transfer.streamed_modules:
        return True
    plan = context.plan
    used = {component.execution_device, *(d for d in component.device_map.values() if is_accelerator(d))}
    return plan is not None and any(used & per_call_places(other) for other in plan.components.values())


def per_call_places(component: ComponentPlan) -> set:
    """The accelerators `component` loads modules onto per call (its execution device, `per_call_devices`)."""
    transfer = component.transfer
    if transfer is None or not transfer.per_call_modules:
        return set()
    away = transfer.per_call_devices
    places = {away[path] for path in transfer.per_call_modules if path in away}
    if any(path not in away for path in transfer.per_call_modules):
        places.add(component.execution_device)
    return places


def streams_everything(component: ComponentPlan) -> bool:
    """Offloaded to an accelerator with every weight homed on the host: streamed block by block."""
    return (component.kind is PlacementKind.OFFLOADED and is_accelerator(component.execution_device)
            and not any(is_accelerator(device) for device in component.device_map.values()))


def technique_of(hook: ModelHook) -> Technique | None:
    """The technique a hook belongs to (None: a hook of no technique of ours, e.g. a user's own)."""
    declared = getattr(type(hook), "technique", None)
    if isinstance(declared, Technique):
        return declared
    if isinstance(hook, CpuOffload):
        return Technique.MODEL_OFFLOAD
    if isinstance(hook, AlignDevicesHook):
        # accelerate's cpu_offload puts an input-moving hook without execution device at the root, and
        # offloading hooks below it; a device map's hooks have an execution device and keep their weights.
        if hook.offload or hook.execution_device is None:
            return Technique.SEQUENTIAL_OFFLOAD
        return Technique.DEVICE_MAP
    return None


def techniques_on(root: nn.Module) -> dict[Technique, str]:
    """Each technique found in `root`'s tree, with the first module (qualified name) that carries it."""
    found: dict[Technique, str] = {}
    for name, module in root.named_modules():
        for hook in hooks_of(module):
            technique = technique_of(hook)
            if technique is not None:
                found.setdefault(technique, name or "<root>")
    return found


class _Table:
    """The rows of the technique table, handed over by `technique_table` when the package is imported (the
    table imports every technique, so the techniques cannot import it): the conflict check reads the rows of
    the techniques already on a tree through it."""

    rows: Mapping[Technique, TechniqueSpec] = {}


def use_table(rows: Mapping[Technique, TechniqueSpec]) -> None:
    _Table.rows = rows


def check_compatible(module: nn.Module, applying: TechniqueSpec) -> None:
    """Raise `OffloadConflictError` if `module`'s tree carries a technique that `applying`'s row refuses, or
    whose row refuses `applying` after it."""
    present = techniques_on(module)
    for other in sorted(present, key=list(Technique).index):
        row = _Table.rows.get(other)
        after = row.refused_after if row is not None else {}
        if other not in applying.refuses and applying.technique not in after:
            continue
        why = applying.refuses.get(other) or after.get(applying.technique) or "the two would fight over its weights"
        remove = f"hooks.{row.remove.__name__}(module)" if row is not None else "hooks.remove_technique(module, ...)"
        raise OffloadConflictError(
            f"Cannot apply {applying.technique.value} to {type(module).__name__}: it already has {other.value} "
            f"(hooks at {present[other]!r}); {why}. Remove it first ({remove}; on a pipeline: reset_device_map())."
        )


__all__ = ["Handle", "PlanContext", "Technique", "TechniqueSpec", "check_compatible", "follows_transfer_plan",
           "per_call_places", "streams_everything", "technique_of", "techniques_on", "use_table"]
