"""Per-call residency: run a component as its plan's transfer model says, module by module.

    coordinator = DeviceCoordinator(place=0, room=room_on_gpu0)      # shared by the components on GPU 0
    handle = apply_residency(denoiser, ResidencyConfig(
        execution_device=0, device_map={"blocks.0": 0, "blocks.1": "cpu", "blocks.2": "cpu", "norm": 0},
        per_call_modules=("blocks.1",), streamed_modules=("blocks.2",), coordinator=coordinator))

The three residency levels of `placement.ComponentTransfer`, at module granularity:
- resident: the device-map entries naming an accelerator; the loader put their weights there, nothing moves;
- per call: homed on the host ("cpu" RAM, pinned where CUDA is, or "disk": read from the checkpoint's own
  files), brought to the execution device when the component's phase starts (its first run of a call), kept
  through all its runs, released only when another component's phase on that device needs the room:
  diffusers' model offload, at block granularity and within the budget. No hook sits on these modules: the
  component's top hook loads them all;
- streamed: homed on the host, moved block by block at every run with the next block prefetched on a side
  stream where CUDA is (group offloading's groups and hooks, on the streamed blocks only).
A listed module holding block lists (a `ModuleList`/`Sequential` at any depth, as `placement.streaming`
finds them) is cut into its blocks and the rest, so per-call releases and streaming go block by block; a
listed block is one unit. The rest of a streamed module is needed through the whole run: the top hook
brings it at the start of each run and sends it back at the end (no hook on the modules holding it).

One hook per component boundary: `ResidencyHook` at the top (inputs to the execution device, outputs back
to the caller's; its phase starts there, and for `encode`/`decode` calls in their wrappers), input-moving
hooks at the device-map entries only when resident entries sit on another accelerator, group hooks on the
streamed units. Which per-call units leave when room is needed is the `DeviceCoordinator`'s choice: the
components it serves on one device tell it when their phase starts; it releases the units of the component
that ran longest ago, last unit first, until the arriving component's per-call units, its activations and its
stream buffers fit in `room` (the device's budget minus runtime overhead and everyone's resident weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from placement.device_maps import flatten_device_map, owning_key, tensor_devices
from placement.devices import Device, is_accelerator, normalize_device, torch_device
from placement.plan_schema import ComponentPlan, Plan, PlacementKind
from placement.streaming import RESIDENT_BLOCKS, block_groups

from .errors import TransferPlanError
from .group_offload.grouping import GroupSpec, OffloadType, plan_groups, whole_group
from .group_offload.module_group import ModuleGroup, ReleaseRule
from .group_offload.offload import GroupMemberHook, GroupOffloadingConfig, GroupOffloadSession
from .group_offload.storage import CheckpointStore, HostStore
from .group_offload.transfer import BlockingTransfer, StreamTransfer
from .hook_utils import add_hook_first, add_hook_last, remove_hooks_of_type
from .input_moving import MoveInputsHook, move_inputs_of_entry_methods, restore_entry_methods
from .techniques import Handle, PlanContext, Technique, TechniqueSpec, check_compatible, follows_transfer_plan
from .tensor_slots import collect_entries

HOST = ("cpu", "disk")


class DeviceCoordinator:
    """The per-call units on one accelerator, shared by the components of a pipeline that execute there.

    `room`: bytes the per-call units, the running component's activations and its stream buffers may use on
    the device (None: unlimited, nothing is released until removal)."""

    def __init__(self, *, place: Device, room: int | None) -> None:
        self.place = place
        self.room = room
        self.phases: list[ComponentPhase] = []
        self._clock = 0

    def __repr__(self) -> str:
        return f"DeviceCoordinator(place={self.place!r}, room={self.room}, phases={[p.name for p in self.phases]})"

    def enter(self, phase: ComponentPhase) -> None:
        """`phase` starts on this device: release what it needs the room of, then load its per-call units."""
        self._clock += 1
        phase.last_entered = self._clock
        if self.room is not None:
            allowed = self.room - phase.transient_bytes - phase.per_call_bytes
            excess = sum(other.loaded_bytes for other in self.phases if other is not phase) - allowed
            idle = sorted((p for p in self.phases if p is not phase and not p.active), key=lambda p: p.last_entered)
            for other in idle:
                if excess <= 0:
                    break
                excess -= other.release(excess)
        phase.load()


class ComponentPhase:
    """One component's per-call units and streamed session, entered at each run (`enter`/`exit` nest)."""

    def __init__(self, *, name: str, place: Device, per_call: list[ModuleGroup], per_run: list[ModuleGroup],
                 session: GroupOffloadSession | None, coordinator: DeviceCoordinator, transient_bytes: int,
                 config: ResidencyConfig | None = None) -> None:
        self.name = name
        self.config = config  # what it was applied with (an edit regroups its units by the same lists)
        self.place = place
        self.per_call = per_call
        self.per_run = per_run  # streamed units needed through a whole run (the rest of a streamed module)
        self.session = session
        self.coordinator = coordinator
        self.transient_bytes = transient_bytes
        self.per_call_bytes = sum(group.num_bytes for group in per_call)
        self.depth = 0
        self.last_entered = 0
        self.exit_hook = None  # the torch forward hook that ends a run, also when the forward raised

    @property
    def active(self) -> bool:
        return self.depth > 0

    @property
    def loaded_bytes(self) -> int:
        return sum(group.num_bytes for group in self.per_call if group.is_onloaded)

    def enter(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.coordinator.enter(self)
            _onload(self.per_run)
            if self.session is not None:
                self.session.begin_call()

    def exit(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            if self.session is not None:
                self.session.end_call()
            for group in self.per_run:
                group.offload()

    def load(self) -> None:
        _onload(self.per_call)

    def release(self, needed: int) -> int:
        """Offload per-call units, last first, until `needed` bytes are free; returns the bytes freed."""
        freed = 0
        for group in reversed(self.per_call):
            if freed >= needed:
                break
            if group.is_onloaded:
                group.offload()
                freed += group.num_bytes
        return freed

    def close(self) -> None:
        """Undo: every unit back where the loader put it (disk weights: on the CPU), coordinator forgets it."""
        if self.exit_hook is not None:
            self.exit_hook.remove()
            self.exit_hook = None
        if self in self.coordinator.phases:
            self.coordinator.phases.remove(self)
        for group in [*self.per_call, *self.per_run]:
            group.restore()
        if self.session is not None:
            self.session.close()


def _onload(groups: list[ModuleGroup]) -> None:
    started = [group for group in groups if group.onload()]
    for group in started:
        group.wait_until_ready()


class ResidencyHook(MoveInputsHook):
    """At the top of the component: a run starts its phase (per-call units loaded when it is the first)."""

    technique = Technique.PER_CALL_RESIDENCY

    def __init__(self, phase: ComponentPhase) -> None:
        super().__init__(torch_device(phase.place), io_same_device=True, place=phase.place)
        self.phase = phase

    def pre_forward(self, module, *args, **kwargs):
        self.phase.enter()  # ended by the phase's exit hook, which torch runs even when the forward raises
        return super().pre_forward(module, *args, **kwargs)

    def detach_hook(self, module):
        self.phase.close()
        return module


class StreamedBlockHook(GroupMemberHook):
    """Group offloading's hook, on a streamed unit of a per-call-residency component."""

    technique = Technique.PER_CALL_RESIDENCY


@dataclass(frozen=True, kw_only=True)
class ResidencyConfig:
    """A component's placement with its transfer model (see the module docstring). `device_map` is relative
    to the component; `per_call_modules` / `streamed_modules` list module paths homed on the host, every
    host-homed tensor under exactly one; `disk_weights` serves the "disk" ones; `coordinator` is shared by
    the components executing on the same device (None: one of its own, with unlimited room);
    `activation_bytes` is what its runs need besides weights; `use_stream` None means on CUDA."""

    execution_device: Device
    device_map: Mapping[str, Device]
    per_call_modules: tuple[str, ...] = ()
    streamed_modules: tuple[str, ...] = ()
    disk_weights: Mapping[str, Mapping[str, str]] | None = None
    coordinator: DeviceCoordinator | None = None
    activation_bytes: int = 0
    use_stream: bool | None = None


def apply_residency(module: nn.Module, config: ResidencyConfig) -> Handle:
    """Run `module` as `config` places it; the handle's `state` is its `ComponentPhase`. Sets hf_device_map."""
    check_compatible(module, SPEC)
    place = normalize_device(config.execution_device)
    if not is_accelerator(place):
        raise TransferPlanError(f"Per-call residency executes on an accelerator, not {place!r}.")
    device_map = flatten_device_map(module, {key: normalize_device(d) for key, d in config.device_map.items()})
    _check_lists(module, device_map, config)
    device = torch_device(place)
    use_stream = device.type == "cuda" if config.use_stream is None else config.use_stream
    transfer = StreamTransfer(device) if use_stream else BlockingTransfer()
    per_call, streamed = _build_units(module, config, place, transfer)
    per_run = [group for group in streamed if group.release is ReleaseRule.WHEN_IDLE]
    blocks = [group for group in streamed if group.release is ReleaseRule.AFTER_LAST_MODULE]
    session = None
    if blocks:
        session = GroupOffloadSession(config=GroupOffloadingConfig(onload_device=place, use_stream=use_stream),
                                      groups=blocks, prefetches=transfer.prefetches, disk_folder=None)
    coordinator = config.coordinator or DeviceCoordinator(place=place, room=None)
    phase = ComponentPhase(name=type(module).__name__, place=place, per_call=per_call, per_run=per_run,
                           session=session, coordinator=coordinator,
                           transient_bytes=config.activation_bytes + _stream_buffers(per_run, blocks), config=config)
    try:
        for group in [*per_call, *streamed]:
            group.take_weights()
        _install(module, phase, device_map, blocks)
    except BaseException:
        remove_residency(module)
        phase.close()
        raise
    coordinator.phases.append(phase)
    module.hf_device_map = dict(device_map)
    return Handle(technique=Technique.PER_CALL_RESIDENCY, module=module, config=config, remover=remove_residency,
                  state=phase)


def remove_residency(module: nn.Module) -> None:
    """Remove the residency hooks of `module`'s tree; per-call and streamed weights go back where they were."""
    if remove_hooks_of_type(module, (ResidencyHook, StreamedBlockHook, MoveInputsHook)):
        restore_entry_methods(module)
        if getattr(module, "hf_device_map", None) is not None:
            module.hf_device_map = None


def _check_lists(module: nn.Module, device_map: Mapping[str, Device], config: ResidencyConfig) -> None:
    """Listed paths exist, hold only host-homed tensors, and cover every host-homed tensor exactly once."""
    what = type(module).__name__
    listed = [*config.per_call_modules, *config.streamed_modules]
    modules = dict(module.named_modules())
    unknown = [path for path in listed if path not in modules]
    if unknown:
        raise TransferPlanError(f"{what}: the transfer plan lists {unknown}, which are not submodules of it.")
    homes = tensor_devices(module, device_map)
    covered: dict[str, list[str]] = {}
    for name in homes:
        for path in listed:
            if owning_key(name, [path]) is not None:
                covered.setdefault(name, []).append(path)
    resident = sorted(name for name, paths in covered.items() if homes[name] not in HOST)
    twice = sorted(name for name, paths in covered.items() if len(paths) > 1)
    missing = sorted(name for name, home in homes.items() if home in HOST and name not in covered)
    for problem, names in (("are resident (on an accelerator) but listed as per-call/streamed", resident),
                           ("are listed twice (per-call and streamed lists overlap)", twice),
                           ("are homed on the host but in neither per_call_modules nor streamed_modules", missing)):
        if names:
            raise TransferPlanError(f"{what}: {len(names)} tensor(s) {problem}, e.g. {names[:3]}. Re-plan, or list "
                                    "each host-homed module in exactly one of the two lists.")


def _build_units(module: nn.Module, config: ResidencyConfig, place: Device, transfer):
    entries = collect_entries(module)
    block_paths = block_groups(module).block_paths
    claimed: set[int] = set()
    pin = transfer.uses_pinned_memory

    def units(paths) -> list[ModuleGroup]:
        built = []
        for path in paths:
            for spec in _specs(module, path, block_paths, entries):
                kept = tuple(e for e in spec.entries if id(e.get()) not in claimed)  # tied: first unit keeps it
                claimed.update(id(e.get()) for e in kept)
                if kept:
                    built.append(_group(spec, kept, place, transfer, config.disk_weights, pin))
        return built

    return units(config.per_call_modules), units(config.streamed_modules)


def _specs(module: nn.Module, path: str, block_paths: list[str], entries) -> list[GroupSpec]:
    in_block = any(owning_key(path, [block]) is not None for block in block_paths)
    if in_block or not block_groups(module.get_submodule(path)).block_lists:
        spec = whole_group(module, path, entries)
        return [] if spec is None else [spec]
    return plan_groups(module, OffloadType.BLOCK_LEVEL, 1, under=path, entries=entries)


def _group(spec: GroupSpec, entries, place: Device, transfer, disk_weights, pin: bool) -> ModuleGroup:
    if any(entry.get().is_meta for entry in entries):
        store = CheckpointStore(disk_weights=disk_weights or {}, pin_memory=pin)
    else:
        store = HostStore(offload_device=torch.device("cpu"), pin_memory=pin)
    return ModuleGroup(name=spec.name, modules=spec.modules, entries=entries, release=spec.release,
                       onload_device=torch_device(place), onload_place=place, store=store, transfer=transfer)


def _stream_buffers(per_run: list[ModuleGroup], blocks: list[ModuleGroup]) -> int:
    """What streaming keeps on the device at once: the units onloaded for the whole run, plus the largest
    blocks (the running one and the prefetched one), as the planner counts it."""
    largest = sorted((group.num_bytes for group in blocks), reverse=True)[:RESIDENT_BLOCKS]
    return sum(group.num_bytes for group in per_run) + sum(largest)


def _install(module: nn.Module, phase: ComponentPhase, device_map: Mapping[str, Device], blocks) -> None:
    for group in blocks:
        for member in group.modules:
            add_hook_first(member, StreamedBlockHook(group=group, session=phase.session, is_root=False))
    if any(is_accelerator(d) and d != phase.place for d in device_map.values()):  # resident parts elsewhere
        modules = dict(module.named_modules())
        for key, home in device_map.items():
            if key and key in modules:
                target = home if is_accelerator(home) else phase.place
                add_hook_last(modules[key], MoveInputsHook(torch_device(target), place=target))
    add_hook_first(module, ResidencyHook(phase))
    move_inputs_of_entry_methods(module, torch_device(phase.place), place=phase.place, phase=phase)
    phase.exit_hook = module.register_forward_hook(lambda *_: phase.exit(), always_call=True)


def room_on(plan: Plan, place: Device) -> int | None:
    """Bytes for per-call units, activations and stream buffers on `place`: its budget minus the runtime
    overhead and every component's resident weights there (None: no budget, unlimited)."""
    device = next((d for d in plan.devices if d.device == place), None)
    if device is None or device.budget is None:
        return None
    resident = sum(component.placed_bytes.get(place, 0) for component in plan.components.values())
    return device.budget - device.overhead - resident


def _plan_config(component: ComponentPlan, context: PlanContext) -> ResidencyConfig:
    transfer, place = component.transfer, component.execution_device
    key = (Technique.PER_CALL_RESIDENCY, place)
    if key not in context.shared:
        room = None if context.plan is None else room_on(context.plan, place)
        context.shared[key] = DeviceCoordinator(place=place, room=room)
    return ResidencyConfig(execution_device=place, device_map=component.device_map,
                           per_call_modules=tuple(transfer.per_call_modules),
                           streamed_modules=tuple(transfer.streamed_modules), disk_weights=context.disk_weights,
                           coordinator=context.shared[key], activation_bytes=component.activation_bytes or 0)


SPEC = TechniqueSpec(
    technique=Technique.PER_CALL_RESIDENCY,
    config_class=ResidencyConfig,
    apply=apply_residency,
    remove=remove_residency,
    refuses={Technique.DEVICE_MAP: "", Technique.MODEL_OFFLOAD: "", Technique.SEQUENTIAL_OFFLOAD: "",
             Technique.GROUP_OFFLOAD: "", Technique.PER_CALL_RESIDENCY: "a placement is applied once"},
    refused_after={Technique.MODEL_OFFLOAD: "", Technique.SEQUENTIAL_OFFLOAD: "", Technique.GROUP_OFFLOAD: "",
                   Technique.LAYERWISE_CASTING: "apply layerwise casting first, then the placement"},
    offloads_weights=True,
    plan_kinds=frozenset({PlacementKind.WHOLE, PlacementKind.SPLIT, PlacementKind.OFFLOADED, PlacementKind.DISK}),
    serves=follows_transfer_plan,
    plan_config=_plan_config,
)

__all__ = ["SPEC", "ComponentPhase", "DeviceCoordinator", "ResidencyConfig", "ResidencyHook", "StreamedBlockHook",
           "apply_residency", "remove_residency", "room_on"]
