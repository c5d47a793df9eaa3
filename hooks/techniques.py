"""The technique table: each technique's file declares its technique (its config class names it, `TechniqueConfig`)
and registers its row (`TechniqueSpec`); `hooks/__init__.py` imports every file of the package (`load_techniques`)
and exports each row's config, apply and remove (`technique_face`), so a new technique is its file and its test row.
Readers (the conflict check, the plan dispatcher, `editing`, `gather`) iterate over the rows, never asking which
hook type a module carries. Our hooks name their technique in a `technique` class attribute; accelerate's are
recognised by type.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from accelerate.hooks import AlignDevicesHook, CpuOffload, ModelHook
from torch import nn

from placement.devices import is_accelerator
from placement.plan_schema import ComponentPlan, Plan, PlacementKind

from .errors import OffloadConfigError, OffloadConflictError, PlacementRuntimeError
from .hook_utils import hooks_of


class _Techniques(type):
    """`Technique.NAME` names a technique before or after its file declares it (rows refuse techniques of files
    imported later); iterating gives the declared ones in declaration order; `Technique(value)` finds one by value."""

    def __getattr__(cls, name: str) -> "Technique":
        if not name.isupper():
            raise AttributeError(name)
        return cls._named.setdefault(name, cls._make(name))

    def __iter__(cls) -> Iterator["Technique"]:
        return iter(cls._declared)

    def __call__(cls, value: "Technique | str") -> "Technique":
        if isinstance(value, Technique):
            return value
        found = [t for t in cls._declared if t.value == value]
        if not found:
            raise OffloadConfigError(f"No technique {value!r}; the techniques are {[t.value for t in cls._declared]}.")
        return found[0]


class Technique(metaclass=_Techniques):
    """A runtime technique: `name` as code spells it (`Technique.GROUP_OFFLOAD`), `value` as users and messages
    read it ("group offloading"). One object per name, declared by its technique's config class."""

    __slots__ = ("name", "value")
    _named: ClassVar[dict[str, "Technique"]] = {}
    _declared: ClassVar[list["Technique"]] = []

    @classmethod
    def _make(cls, name: str) -> "Technique":
        member = object.__new__(cls)
        member.name, member.value = name, None
        return member

    @classmethod
    def declare(cls, name: str, value: str) -> "Technique":
        """`Technique.<name>`, read as `value`; declaring a name or a value twice is refused."""
        member = getattr(cls, name)
        if member.value is not None or any(t.value == value for t in cls._declared):
            raise PlacementRuntimeError(f"Technique {name} ({value!r}) is declared twice; each technique's file "
                                        "declares its own, once.")
        member.value = value
        cls._declared.append(member)
        return member

    @classmethod
    def undeclared(cls) -> list[str]:
        """Names used (`Technique.NAME`) that no file declared: a misspelt technique in some row."""
        return [name for name, member in cls._named.items() if member.value is None]

    def __repr__(self) -> str:
        return f"Technique.{self.name}"

    def __str__(self) -> str:
        return str(self.value)

    def __reduce__(self):
        return getattr, (Technique, self.name)  # copies and pickles are the one member


class TechniqueConfig:
    """The base of a technique's config class, which declares its technique (as a config names its owner):
    `class FooConfig(TechniqueConfig, technique="foo streaming", name="FOO")` makes `Technique.FOO`, read
    "foo streaming", with `FooConfig.technique` bound to it."""

    technique: ClassVar[Technique]

    def __init_subclass__(cls, *, technique: str, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.technique = Technique.declare(name, technique)


@dataclass(kw_only=True)
class PlanContext:
    """What a row gets besides the component: the plan (None: applied alone), its "disk" weights' files, and
    state the components of one pipeline share (per-call residency's coordinators)."""

    plan: Plan | None = None
    disk_weights: Mapping[str, Mapping[str, str]] | None = None
    shared: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TechniqueSpec:
    """One row of the technique table."""

    technique: Technique
    config_class: type[TechniqueConfig]
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
    # What a plan's application adds after `apply` (group offloading: outputs back to the caller's device).
    finish_plan: Callable[[nn.Module], None] | None = None
    # editor(module) -> an object with open(), close() -> problems, homes() (see `editing`); None: edited as is.
    editor: Callable[[nn.Module], Any] | None = None
    # gather(module) -> {(id(owning module), attribute): source} for the `meta` placeholders it serves (`gather`).
    gather: Callable[[nn.Module], Mapping[tuple[int, str], Any]] | None = None

    def runs(self, component: ComponentPlan, context: PlanContext) -> bool:
        if component.kind not in self.plan_kinds or self.plan_config is None:
            return False
        return self.serves is None or self.serves(component, context)


@dataclass(frozen=True, kw_only=True, eq=False)
class Handle:
    """What `apply_x(module, config)` returns; `state` is the technique's runtime state (session, phase) or None."""

    technique: Technique
    module: nn.Module
    config: Any
    remover: Callable[[nn.Module], None] = field(repr=False)
    state: Any = None

    def remove(self) -> None:
        self.remover(self.module)


def follows_transfer_plan(component: ComponentPlan, context: PlanContext) -> bool:
    """The component runs by its transfer plan (per-call residency): it lists per-call or streamed modules, or
    uses an accelerator where another component loads modules per call (whose room its runs may need)."""
    transfer = component.transfer
    if transfer is None or not is_accelerator(component.execution_device):
        return False
    if transfer.per_call_modules or transfer.streamed_modules:
        return True
    plan = context.plan
    used = {component.execution_device, *(d for d in component.device_map.values() if is_accelerator(d))}
    return plan is not None and any(used & per_call_places(other) for other in plan.components.values())


def per_call_places(component: ComponentPlan) -> set:
    """The accelerators `component` loads modules onto per call."""
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


_ROWS: dict[Technique, TechniqueSpec] = {}
TECHNIQUES: Mapping[Technique, TechniqueSpec] = MappingProxyType(_ROWS)  # in `Technique` order
# The techniques whose hooks keep their own copies of the weights: a module under them cannot be .to()-ed.
OFFLOADING: set[Technique] = set()


def register(spec: TechniqueSpec) -> TechniqueSpec:
    """Add `spec` to `TECHNIQUES` (a technique's file calls it on its row, for the technique its config class
    declares); returns it."""
    if spec.config_class.technique is not spec.technique:
        raise PlacementRuntimeError(
            f"The row of {spec.technique!r} takes {spec.config_class.__name__}, which declares "
            f"{spec.config_class.technique!r}: a row runs the technique its config class names.")
    _ROWS[spec.technique] = spec
    ordered = sorted(_ROWS.values(), key=lambda row: list(Technique).index(row.technique))
    _ROWS.clear()
    _ROWS.update((row.technique, row) for row in ordered)
    if spec.offloads_weights:
        OFFLOADING.add(spec.technique)
    return spec


def load_techniques(package: str, path: Collection[str]) -> None:
    """Import every module of `package` (at `path`), so that each technique's file declares and registers its
    own row: adding a technique lists it nowhere else."""
    for info in pkgutil.walk_packages(path, f"{package}."):
        importlib.import_module(info.name)


def technique_face() -> dict[str, Any]:
    """What the package exports of each row, by name: its config class, its apply and its remove function."""
    return {part.__name__: part for spec in TECHNIQUES.values()
            for part in (spec.config_class, spec.apply, spec.remove)}


def check_compatible(module: nn.Module, applying: TechniqueSpec) -> None:
    """Raise `OffloadConflictError` if `module`'s tree carries a technique that `applying`'s row refuses, or
    whose row refuses `applying` after it."""
    present = techniques_on(module)
    for other in sorted(present, key=list(Technique).index):
        row = _ROWS.get(other)
        after = row.refused_after if row is not None else {}
        if other not in applying.refuses and applying.technique not in after:
            continue
        why = applying.refuses.get(other) or after.get(applying.technique) or "the two would fight over its weights"
        remove = f"hooks.{row.remove.__name__}(module)" if row is not None else "hooks.remove_technique(module, ...)"
        raise OffloadConflictError(
            f"Cannot apply {applying.technique.value} to {type(module).__name__}: it already has {other.value} "
            f"(hooks at {present[other]!r}); {why}. Remove it first ({remove}; on a pipeline: reset_device_map())."
        )


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


def apply_component_plan(module: nn.Module, component: ComponentPlan, *,
                         disk_weights: Mapping[str, Mapping[str, str]] | None = None,
                         context: PlanContext | None = None) -> Any:
    """Attach the hooks that run `module` as `component` places it (`context`: what the components of one
    `apply_plan` share); sets `module.hf_device_map`. If applying fails, nothing is left on the module."""
    context = PlanContext() if context is None else context
    context = replace(context, disk_weights=disk_weights)
    spec = technique_for(component, context)
    try:
        handle = spec.apply(module, spec.plan_config(component, context))
        if spec.finish_plan is not None:
            spec.finish_plan(module)
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
               disk_weights: Mapping[str, Mapping[str, Mapping[str, str]] | None] | None = None,
               placed_by_owner: Collection[str] = ()) -> PlacedModules:
    """Attach the runtime of every component of `plan` to `modules`, sharing one per-call coordinator per
    accelerator. `disk_weights`: each component's offload index; `placed_by_owner`: components the caller runs
    otherwise (they get nothing here). If one component fails, those already done are undone."""
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


__all__ = ["OFFLOADING", "TECHNIQUES", "Handle", "PlacedModules", "PlanContext", "Technique", "TechniqueConfig",
           "TechniqueSpec", "apply_component_plan", "apply_plan", "apply_to_each", "check_compatible",
           "follows_transfer_plan", "load_techniques", "per_call_places", "register", "remove_technique",
           "streams_everything", "technique_face", "technique_for", "technique_of", "techniques_on"]
