"""Per-call residency: run a component as its plan's transfer model says, module by module.

    handle = apply_residency(denoiser, ResidencyConfig(
        execution_device=0, device_map={"blocks.0": 0, "blocks.1": "cpu", "blocks.2": "cpu", "norm": 0},
        per_call_modules=("blocks.1",), streamed_modules=("blocks.2",), coordinators={0: DeviceCoordinator(...)}))

Resident entries stay where the loader put them. Per-call units (host- or disk-homed) are loaded when the
component's phase starts, kept through its runs and released only when another phase on that device needs the
room (`residency_phases`): diffusers' model offload at block granularity, within the budget. Streamed units move
block by block at every run through group offloading's session and hooks, each copy issued behind the compute
before it. A listed module holding block lists is cut into its blocks and the rest. Only where part of the
component runs on another accelerator do input-moving hooks go where the device changes (`input_routes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from placement.device_maps import distinct_tensor_names, flatten_device_map, owning_key, tensor_devices
from placement.devices import Device, is_accelerator, normalize_device, torch_device
from placement.plan_schema import ComponentPlan, Plan, PlacementKind
from placement.streaming import block_groups

from .dispatch import _called_modules as called_modules
from .errors import OffloadConfigError
from .editing import mapped_homes, settle
from .group_offload.module_group import GroupSpec, ModuleGroup, ReleaseRule, make_transfer, held_tensor
from .group_offload.module_group import regroup, unit_specs
from .group_offload.offload import GroupMemberHook, GroupOffloadingConfig, GroupOffloadSession, GroupsEdit
from .group_offload.offload import hooked_group_slots, unhook_groups
from .group_offload.storage import CheckpointStore, HostStore
from .group_offload.transfer import BlockingTransfer, StreamTransfer
from . import trace
from . import transfer_meter as meter
from .hook_utils import add_hook_first, add_hook_last, hooks_of, remove_hooks_of_type
from .input_moving import MoveInputsHook, move_inputs_of_entry_methods, restore_entry_methods, return_to_caller
from .residency_phases import ComponentPhase, DeviceCoordinator, DeviceShare
from .techniques import Handle, PlanContext, Technique, TechniqueConfig, TechniqueSpec, check_compatible
from .techniques import follows_transfer_plan, register
from .tensor_slots import collect_entries, named_tensors

HOST = ("cpu", "disk")


class ResidencyHook(MoveInputsHook):
    """At the top of the component: inputs to its execution device, outputs back (runs: `phase.run_hooks`)."""

    technique = Technique.PER_CALL_RESIDENCY

    def __init__(self, phase: ComponentPhase) -> None:
        super().__init__(torch_device(phase.place), io_same_device=True, place=phase.place)
        self.phase = phase

    def detach_hook(self, module):
        self.phase.close()
        return module

    def groups(self) -> list[ModuleGroup]:
        return [*self.phase.per_call, *self.phase.per_run]


class HandBackHook(MoveInputsHook):
    """On the last block of a list that ran on another accelerator: outputs back to the execution device."""

    def __init__(self, place: Device, *, back: Device) -> None:
        super().__init__(torch_device(place), place=place)
        self.back = back

    def post_forward(self, module: nn.Module, output):
        if self._entered:
            meter.leave_place(self.place)
            self._entered = False
        return return_to_caller(output, torch_device(self.back), source=self.place, target=self.back)


class StreamedBlockHook(GroupMemberHook):
    technique = Technique.PER_CALL_RESIDENCY


@dataclass(frozen=True, kw_only=True)
class ResidencyConfig(TechniqueConfig, technique="per-call residency", name="PER_CALL_RESIDENCY"):
    """A component's placement with its transfer model. Every host-homed tensor is under exactly one of
    `per_call_modules` / `streamed_modules`; `per_call_devices`: per-call modules loaded onto another accelerator;
    `streamed_devices`: streamed modules that stream onto another accelerator, through its own stream buffers (each GPU
    runs its span of blocks: pooled residency); `coordinators` (one per accelerator, shared by a pipeline's
    components; missing: unlimited room);
    `activation_bytes`: what runs need besides weights on each accelerator used; `use_stream` None: on CUDA."""

    execution_device: Device
    device_map: Mapping[str, Device]
    per_call_modules: tuple[str, ...] = ()
    streamed_modules: tuple[str, ...] = ()
    per_call_devices: Mapping[str, Device] = field(default_factory=dict)
    streamed_devices: Mapping[str, Device] = field(default_factory=dict)
    disk_weights: Mapping[str, Mapping[str, str]] | None = None
    coordinators: Mapping[Device, DeviceCoordinator] = field(default_factory=dict)
    activation_bytes: int = 0
    use_stream: bool | None = None
    name: str = ""  # what traces call the component (`hooks.trace_calls`); its class name when empty


def apply_residency(module: nn.Module, config: ResidencyConfig) -> Handle:
    """Run `module` as `config` places it; the handle's `state` is its `ComponentPhase`. Sets hf_device_map."""
    check_compatible(module, SPEC)
    place = normalize_device(config.execution_device)
    if not is_accelerator(place):
        raise OffloadConfigError(f"Per-call residency executes on an accelerator, not {place!r}.")
    device_map = flatten_device_map(module, {key: normalize_device(d) for key, d in config.device_map.items()})
    away = {path: normalize_device(d) for path, d in config.per_call_devices.items()}
    streams_away = {path: normalize_device(d) for path, d in config.streamed_devices.items()}
    _check_lists(module, device_map, config, away, streams_away)
    transfers = _transfers(config.use_stream)
    per_call, streamed = _build_units(module, config, place, away, streams_away, transfers)
    away = {**away, **streams_away}  # where each module that leaves the execution device runs
    per_run = [group for group in streamed if group.release is ReleaseRule.WHEN_IDLE]
    blocks = [group for group in streamed if group.release is ReleaseRule.AFTER_LAST_MODULE]
    sessions = {onto: _session(onto, [group for group in blocks if group.onload_place == onto], transfers)
                for onto in dict.fromkeys(group.onload_place for group in blocks)}
    phase = ComponentPhase(name=type(module).__name__, place=place, per_run=per_run, sessions=sessions,
                           activation_bytes=config.activation_bytes, config=config)
    for device in _devices_used(place, device_map, away):
        phase.share(config.coordinators, device, per_call.get(device, []))
    try:
        for group in [*phase.per_call, *streamed]:
            group.take_weights()
        _install(module, phase, device_map, away, blocks)
        _label(module, phase, device_map, away, blocks, per_call)
    except BaseException:
        remove_residency(module)
        phase.close()
        raise
    phase.join()
    module.hf_device_map = dict(device_map)
    return Handle(technique=Technique.PER_CALL_RESIDENCY, module=module, config=config, remover=remove_residency,
                  state=phase)


def _session(place: Device, blocks: list[ModuleGroup], transfers) -> GroupOffloadSession:
    """The streamed blocks onto one accelerator and their prefetch chain: each GPU sends its first block when a
    run starts and the next one when a block starts, on its own link, whatever the other GPUs do."""
    config = GroupOffloadingConfig(onload_device=place, use_stream=transfers(place).prefetches)
    return GroupOffloadSession(config=config, groups=blocks, prefetches=True, disk_folder=None, prefetch_first=True)


def _transfers(use_stream: bool | None) -> Callable[[Device], BlockingTransfer | StreamTransfer]:
    """One transfer per accelerator: a side CUDA stream each, else blocking."""
    @functools.cache
    def of(place: Device) -> BlockingTransfer | StreamTransfer:
        device = torch_device(place)
        return make_transfer(device, device.type == "cuda" if use_stream is None else use_stream)
    return of


def _devices_used(place: Device, device_map: Mapping[str, Device], away: Mapping[str, Device]) -> list[Device]:
    """The accelerators the component's runs use: where it executes, holds resident parts, loads per call."""
    used = [place, *(d for d in device_map.values() if is_accelerator(d)), *away.values()]
    return list(dict.fromkeys(used))


def remove_residency(module: nn.Module) -> None:
    """Remove the residency hooks of `module`'s tree; per-call and streamed weights go back where they were."""
    if remove_hooks_of_type(module, (ResidencyHook, StreamedBlockHook, MoveInputsHook)):
        restore_entry_methods(module)
        if getattr(module, "hf_device_map", None) is not None:
            module.hf_device_map = None


def _check_lists(module: nn.Module, device_map: Mapping[str, Device], config: ResidencyConfig,
                 away: Mapping[str, Device], streams_away: Mapping[str, Device]) -> None:
    """Listed paths exist, hold only host-homed tensors, and cover every host-homed tensor exactly once."""
    what = type(module).__name__
    listed = [*config.per_call_modules, *config.streamed_modules]
    modules = dict(module.named_modules())
    unknown = [path for path in listed if path not in modules and held_tensor(module, path) is None]
    if unknown:
        raise OffloadConfigError(f"{what}: the transfer plan lists {unknown}, which are neither submodules of it "
                                "nor tensors its modules hold.")
    loose = [path for path in config.streamed_modules if path not in modules]
    if loose:
        raise OffloadConfigError(f"{what}: the transfer plan streams {loose}, tensors held outside any block; only "
                                "blocks stream (load them per call). Re-plan.")
    strays = {path: device for path, device in away.items()
              if path not in config.per_call_modules or path not in modules or not is_accelerator(device)}
    if strays:
        raise OffloadConfigError(f"{what}: per_call_devices {strays} must name per-call modules (of "
                                f"{list(config.per_call_modules)}) and accelerators. Re-plan.")
    strays = {path: device for path, device in streams_away.items()
              if path not in config.streamed_modules or not is_accelerator(device)}
    if strays:
        raise OffloadConfigError(f"{what}: streamed_devices {strays} must name streamed modules (of "
                                f"{list(config.streamed_modules)}) and accelerators. Re-plan.")
    homes = tensor_devices(module, device_map)  # a tied tensor once, under its first name
    names_of = {names[0]: names for names in distinct_tensor_names(module)}
    covered: dict[str, list[str]] = {}
    for name in homes:
        for path in listed:
            if any(owning_key(alias, [path]) is not None for alias in names_of[name]):
                covered.setdefault(name, []).append(path)
    resident = sorted(name for name, paths in covered.items() if homes[name] not in HOST)
    twice = sorted(name for name, paths in covered.items() if len(paths) > 1)
    missing = sorted(name for name, home in homes.items() if home in HOST and name not in covered)
    for problem, names in (("are resident (on an accelerator) but listed as per-call/streamed", resident),
                           ("are listed twice (per-call and streamed lists overlap)", twice),
                           ("are homed on the host but in neither per_call_modules nor streamed_modules", missing)):
        if names:
            raise OffloadConfigError(f"{what}: {len(names)} tensor(s) {problem}, e.g. {names[:3]}. Re-plan, or list "
                                    "each host-homed module in exactly one of the two lists.")


def _build_units(module: nn.Module, config: ResidencyConfig, place: Device, away: Mapping[str, Device],
                 streams_away: Mapping[str, Device], transfers
                 ) -> tuple[dict[Device, list[ModuleGroup]], list[ModuleGroup]]:
    """The per-call units by the accelerator they load onto, and the streamed units (onto `place`, or the
    accelerator whose span they run in)."""
    entries = collect_entries(module)
    block_paths = block_groups(module).block_paths
    claimed: set[int] = set()

    def units(path: str, onto: Device) -> list[ModuleGroup]:
        built = []
        for spec in unit_specs(module, path, block_paths, entries):
            kept = tuple(e for e in spec.entries if id(e.get()) not in claimed)  # tied: the first unit keeps it
            claimed.update(id(e.get()) for e in kept)
            if kept:
                built.append(_group(spec, kept, onto, transfers(onto), config.disk_weights))
        return built

    per_call: dict[Device, list[ModuleGroup]] = {}
    for path in config.per_call_modules:
        onto = away.get(path, place)
        per_call.setdefault(onto, []).extend(units(path, onto))
    return per_call, [group for path in config.streamed_modules
                      for group in units(path, streams_away.get(path, place))]


def _group(spec: GroupSpec, entries, place: Device, transfer, disk_weights) -> ModuleGroup:
    pin = transfer.uses_pinned_memory
    if any(entry.get().is_meta for entry in entries):
        store = CheckpointStore(disk_weights=disk_weights or {}, pin_memory=pin)
    else:
        store = HostStore(offload_device=torch.device("cpu"), pin_memory=pin)
    return ModuleGroup(replace(spec, entries=entries), store=store, transfer=transfer,
                       onload_device=torch_device(place), onload_place=place)


def _install(module: nn.Module, phase: ComponentPhase, device_map: Mapping[str, Device],
             away: Mapping[str, Device], blocks: list[ModuleGroup]) -> None:
    _hook_blocks(blocks, phase.sessions)
    for entry, place, back in input_routes(module, device_map, phase.place, away):
        hook = HandBackHook(place, back=back) if back is not None else MoveInputsHook(torch_device(place), place=place)
        add_hook_last(entry, hook)
    add_hook_first(module, ResidencyHook(phase))
    move_inputs_of_entry_methods(module, torch_device(phase.place), place=phase.place, phase=phase)
    phase.run_hooks = [module.register_forward_pre_hook(lambda *_: phase.enter()),
                       module.register_forward_hook(lambda *_: phase.exit(), always_call=True)]


def _hook_blocks(blocks: list[ModuleGroup], sessions: Mapping[Device, GroupOffloadSession]) -> None:
    for group in blocks:
        for member in group.modules:
            add_hook_first(member, StreamedBlockHook(group=group, session=sessions[group.onload_place],
                                                     is_root=False))


def _label(module: nn.Module, phase: ComponentPhase, device_map: Mapping[str, Device], away: Mapping[str, Device],
           blocks: list[ModuleGroup], per_call: Mapping[Device, list[ModuleGroup]]) -> None:
    name = phase.config.name or phase.name
    streamed = {id(member) for group in blocks for member in group.modules}
    trace.label_block(module, trace.BlockLabel(component=name, path="", place=phase.place))
    for path, block in (pair for listed in block_groups(module).block_lists for pair in listed.blocks):
        where = _runs_on(path, device_map, away, phase.place)
        trace.label_block(block, trace.BlockLabel(component=name, path=path, place=where,
                                                  streamed=id(block) in streamed))
    for group in [*blocks, *phase.per_run, *(g for groups in per_call.values() for g in groups)]:
        trace.label_group(group, trace.BlockLabel(component=name, path=group.name, place=group.onload_place))


def input_routes(module: nn.Module, device_map: Mapping[str, Device], place: Device,
                 away: Mapping[str, Device]) -> list[tuple[nn.Module, Device, Device | None]]:
    """(called module, the accelerator it runs on, where its outputs go back to or None) for every module whose
    inputs must move because part of the component runs on another accelerator than `place`: the device-map
    entries, and every block of a list that runs partly elsewhere, its last block handing outputs back."""
    if not away and not any(is_accelerator(d) and d != place for d in device_map.values()):
        return []
    modules = dict(module.named_modules())
    keys = [key for key in device_map if key]
    runs_on = functools.partial(_runs_on, device_map=device_map, away=away, place=place)
    layout = block_groups(module)
    in_lists = [block_list.path for block_list in layout.block_lists]
    routes: dict[int, list] = {}  # id(module) -> [module, place, back]
    for key in [*(k for k in keys if k in modules), *away]:
        device = runs_on(key)
        # A piece of the rest run elsewhere hands its outputs back: the code after it runs on `place`.
        back = place if device != place and not any(_inside(key, path) for path in in_lists) else None
        for entry in called_modules(modules[key]):  # a block list is never called: its blocks are
            routes[id(entry)] = [entry, device, back]
    for block_list in layout.block_lists:
        ran = [(block, runs_on(path)) for path, block in block_list.blocks]
        if all(device == place for _, device in ran):
            continue
        for block, device in ran:
            for entry in called_modules(block):
                routes.setdefault(id(entry), [entry, device, None])
        last = called_modules(ran[-1][0])[-1:]
        if ran[-1][1] != place and last:
            routes[id(last[0])][2] = place
    return [tuple(route) for route in routes.values()]


def _runs_on(path: str, device_map: Mapping[str, Device], away: Mapping[str, Device], place: Device) -> Device:
    """The accelerator a module runs on: where it is loaded per call, else its resident entry's, else `place`."""
    moved = owning_key(path, list(away)) if away else None
    if moved is not None:
        return away[moved]
    owner = owning_key(path, [key for key in device_map if key])
    home = device_map.get(owner) if owner is not None else device_map.get("")
    return home if is_accelerator(home) else place


def _inside(path: str, container: str) -> bool:
    return path == container or path.startswith(f"{container}.")


def room_on(plan: Plan, place: Device) -> int | None:
    """Bytes for per-call units, activations and stream buffers on `place`: its budget less the overhead and
    every component's resident weights there (None: unlimited)."""
    device = next((d for d in plan.devices if d.device == place), None)
    if device is None or device.budget is None:
        return None
    resident = sum(component.placed_bytes.get(place, 0) for component in plan.components.values())
    return device.budget - device.overhead - resident


def _plan_config(component: ComponentPlan, context: PlanContext) -> ResidencyConfig:
    transfer, place = component.transfer, component.execution_device
    coordinators = {}
    for device in _devices_used(place, component.device_map,
                                {**transfer.per_call_devices, **transfer.streamed_devices}):
        key = (Technique.PER_CALL_RESIDENCY, device)
        if key not in context.shared:
            room = None if context.plan is None else room_on(context.plan, device)
            context.shared[key] = DeviceCoordinator(place=device, room=room)
        coordinators[device] = context.shared[key]
    return ResidencyConfig(execution_device=place, device_map=component.device_map,
                           per_call_modules=tuple(transfer.per_call_modules),
                           streamed_modules=tuple(transfer.streamed_modules),
                           per_call_devices=dict(transfer.per_call_devices),
                           streamed_devices=dict(transfer.streamed_devices), disk_weights=context.disk_weights,
                           coordinators=coordinators, activation_bytes=component.activation_bytes or 0,
                           name=component.name)


class ResidencyEdit(GroupsEdit):
    """One edit of a per-call residency component: units are offloaded (per-call ones reload next call), then
    regrouped by the component's own lists; resident tensors stay on their accelerator (`settle`)."""

    def __init__(self, module: nn.Module, phase: ComponentPhase) -> None:
        super().__init__(module)
        self.phase = phase
        self.kinds: dict[int, tuple[str, Device]] = {}  # id(spec) -> its list, and the device it loads onto

    @property
    def groups(self) -> list[ModuleGroup]:
        sessions = self.phase.sessions.values()
        return [*self.phase.per_call, *self.phase.per_run, *(group for session in sessions for group in session.groups)]

    def close(self) -> list[str]:
        problems = self.stand_ins.put_back(self.module)
        phase, config = self.phase, self.phase.config
        away = {path: normalize_device(device) for path, device in config.per_call_devices.items()}
        streams_away = {path: normalize_device(device) for path, device in config.streamed_devices.items()}

        def specs_for(entries):
            block_paths = block_groups(self.module).block_paths
            for kind, paths in (("per_call", config.per_call_modules), ("streamed", config.streamed_modules)):
                for path in paths:
                    for spec in unit_specs(self.module, path, block_paths, entries):
                        onto = (away if kind == "per_call" else streams_away).get(path, phase.place)
                        self.kinds[id(spec)] = (kind, onto)
                        yield spec

        result = regroup(self.module, self.groups, specs_for, self._new_group)
        for spec, group in result.added:
            self._enlist(group, *self.kinds[id(spec)])
        self._drop(result.emptied)  # the shares' byte counts follow their units
        grouped = {id(entry.get()) for group in self.groups for entry in group.entries}
        streamed, no_data = settle(self.module, dict(self.module.hf_device_map), phase.place, grouped)
        problems += [f"{name} (no data: created on meta, nothing serves it)" for name in no_data]
        problems += [f"{path or '<root>'} (host-homed, in no per-call or streamed unit)" for path, _ in streamed]
        return problems

    def _new_group(self, spec: GroupSpec, entries) -> ModuleGroup:
        _, onto = self.kinds.get(id(spec), ("streamed", self.phase.place))
        existing = [group for group in self.groups if group.onload_place == onto]  # its device's transfer
        transfer = existing[0].transfer if existing else BlockingTransfer()
        group = _group(spec, entries, onto, transfer, self.phase.config.disk_weights)
        group.take_weights()
        return group

    def _enlist(self, group: ModuleGroup, kind: str, onto: Device) -> None:
        phase = self.phase
        if kind == "per_call":
            phase.shares[onto].per_call.append(group)
        elif group.release is ReleaseRule.AFTER_LAST_MODULE and onto in phase.sessions:
            phase.sessions[onto].groups.append(group)
            _hook_blocks([group], phase.sessions)
        else:
            phase.per_run.append(group)

    def _drop(self, emptied: list[ModuleGroup]) -> None:
        phase = self.phase
        unhook_groups(self.module, emptied)
        for share in phase.shares.values():
            share.per_call[:] = [group for group in share.per_call if group.entries]
        phase.per_run[:] = [group for group in phase.per_run if group.entries]
        for session in phase.sessions.values():
            session.groups[:] = [group for group in session.groups if group.entries]

    def homes(self) -> dict[str, Device]:
        """Resident tensors at their device-map entry's device, grouped ones where their store keeps them."""
        mapped = mapped_homes(self.module, dict(self.module.hf_device_map))
        resident = {name: mapped.get(id(tensor), "cpu") for name, tensor in named_tensors(self.module)}
        return {**resident, **super().homes()}


def residency_phase(module: nn.Module) -> ComponentPhase | None:
    for hook in hooks_of(module):
        if isinstance(hook, ResidencyHook):
            return hook.phase
    return None


def _editor(module: nn.Module) -> ResidencyEdit | None:
    phase = residency_phase(module)
    return None if phase is None else ResidencyEdit(module, phase)


SPEC = register(TechniqueSpec(
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
    editor=_editor,
    gather=lambda module: hooked_group_slots(module, (ResidencyHook, StreamedBlockHook)),
))

__all__ = ["SPEC", "ComponentPhase", "DeviceCoordinator", "DeviceShare", "HandBackHook", "ResidencyConfig",
           "ResidencyEdit", "ResidencyHook", "StreamedBlockHook", "apply_residency", "input_routes",
           "remove_residency", "residency_phase", "room_on"]
