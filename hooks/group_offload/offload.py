"""Group offloading: weights live in CPU RAM (or on disk) and visit the accelerator one group at a time.

    handle = apply_group_offloading(denoiser, GroupOffloadingConfig(onload_device=0, use_stream=True))
    handle.remove()   # or remove_group_offloading(denoiser), or accelerate's remove_hook_from_module(recurse=True)

With `use_stream` (CUDA only) the first call records the order the groups run in; later calls queue the next
group's copy on a side stream while the current one computes. The session, member hooks and group editor
(`GroupsEdit`) also run per-call residency's streamed units.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field, replace

import torch
from accelerate.hooks import ModelHook
from torch import nn

from placement.devices import Device, normalize_device, torch_device
from placement.errors import InvalidDeviceError
from placement.plan_schema import ComponentPlan, PlacementKind

from .module_group import GroupSpec, ModuleGroup, OffloadType, Regrouped, make_transfer, plan_groups, regroup
from .storage import DiskStore, HostStore
from .. import trace
from .. import transfer_meter as meter
from ..errors import OffloadConfigError
from ..gather import group_slots
from ..hook_utils import add_hook_first, find_hooks, hooks_of, remove_hooks_of_type, remove_hooks_where
from ..hook_utils import running_ancestor
from ..input_moving import ReturnOutputsHook, move_to_device, restore_entry_methods, return_to_caller
from ..input_moving import run_entry_methods_through
from ..techniques import Handle, PlanContext, Technique, TechniqueConfig, TechniqueSpec, check_compatible
from ..techniques import follows_transfer_plan, register, streams_everything
from ..tensor_slots import StandIns, named_tensors

__all__ = ["SPEC", "GroupMemberHook", "GroupOffloadEdit", "GroupsEdit", "GroupOffloadHook", "GroupOffloadingConfig",
           "GroupOffloadSession", "OffloadType", "apply_group_offloading", "group_offloading_fields",
           "group_offloading_session", "remove_group_offloading", "unhook_groups"]

# diffusers' keywords for `apply_group_offloading(module, onload_device=..., ...)` (`group_offloading_fields`).
GROUP_OFFLOAD_FIELDS = ("onload_device", "offload_device", "offload_type", "num_blocks_per_group", "use_stream",
                        "offload_to_disk_path")
TUNING_ONLY = ("non_blocking", "record_stream", "low_cpu_mem_usage")
UNSUPPORTED = ("block_modules", "exclude_kwargs")


@dataclass(frozen=True, kw_only=True)
class GroupOffloadingConfig(TechniqueConfig, technique="group offloading", name="GROUP_OFFLOAD"):
    """How to group-offload a module; normalised on construction."""

    onload_device: torch.device | int | str
    offload_device: torch.device | str = "cpu"
    offload_type: OffloadType | str = OffloadType.BLOCK_LEVEL
    num_blocks_per_group: int = 1
    use_stream: bool = False  # CUDA only: prefetch the next group on a side stream from pinned memory
    offload_to_disk_path: str | os.PathLike | None = None  # groups saved to / read from safetensors files
    # onload_device as the plan spells it (an accelerator index, also a virtual one, or "cpu").
    onload_place: Device = field(init=False, default="cpu", compare=False)

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # normalising a frozen dataclass's own fields
        set_field(self, "onload_place", _place(self.onload_device, "onload_device"))
        set_field(self, "onload_device", _execution_device(self.onload_device, "onload_device"))
        set_field(self, "offload_device", _execution_device(self.offload_device, "offload_device"))
        set_field(self, "offload_type", _offload_type(self.offload_type))
        if self.offload_to_disk_path is not None:
            set_field(self, "offload_to_disk_path", os.fspath(self.offload_to_disk_path))
        blocks = self.num_blocks_per_group
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise OffloadConfigError(f"num_blocks_per_group must be an int >= 1, got {blocks!r}.")
        if self.use_stream and self.onload_device.type != "cuda":
            raise OffloadConfigError(
                f"use_stream=True prefetches on a CUDA side stream, but onload_device is {self.onload_device}. "
                "Pass use_stream=False (offloading then copies synchronously), or a CUDA onload_device."
            )


def _place(spec, name: str) -> Device:
    if isinstance(spec, torch.device) and spec.type == "cpu":
        return "cpu"
    try:
        return normalize_device(spec)
    except InvalidDeviceError as error:
        raise OffloadConfigError(f"GroupOffloadingConfig.{name}={spec!r} is not usable: {error}") from error


def _execution_device(spec, name: str) -> torch.device:
    try:
        return torch_device(normalize_device(spec))  # "disk" is refused there: it cannot execute
    except InvalidDeviceError as error:
        raise OffloadConfigError(
            f"GroupOffloadingConfig.{name}={spec!r} is not usable: {error} "
            "Use an accelerator index / 'cuda:N' / 'cpu'; to keep weights on disk pass offload_to_disk_path."
        ) from error


def _offload_type(value) -> OffloadType:
    try:
        return OffloadType(value)
    except ValueError:
        choices = ", ".join(repr(kind.value) for kind in OffloadType)
        raise OffloadConfigError(f"offload_type={value!r} is not one of {choices}.") from None


class GroupOffloadSession:
    """The groups and prefetch chain shared by all hooks of one application."""

    def __init__(self, *, config: GroupOffloadingConfig, groups: list[ModuleGroup], prefetches: bool,
                 disk_folder: str | None, prefetch_first: bool = False) -> None:
        self.config = config
        self.groups = groups
        self.disk_folder = disk_folder
        self._prefetches = prefetches
        _read_ahead_from_disk(groups)
        # Per-call residency: each run's first group is sent when the run starts, behind the blocks before it.
        self._prefetch_first = prefetch_first
        self._first: ModuleGroup | None = None
        self._trace: list[ModuleGroup] | None = None
        self._next_group: dict[int, ModuleGroup] = {}
        self._traced = False
        self.in_call = False  # between the root's begin_call and end_call
        self._made = len(groups)  # groups ever built, for unique file names of groups added later
        if disk_folder is not None:
            # Files of a module that is garbage-collected without removing the hooks do not outlive it.
            weakref.finalize(self, shutil.rmtree, disk_folder, True)

    @property
    def onload_device(self) -> torch.device:
        return self.config.onload_device

    @property
    def onload_place(self) -> Device:
        return self.config.onload_place

    @property
    def resident_groups(self) -> list[ModuleGroup]:
        return [group for group in self.groups if group.is_onloaded]

    def begin_call(self) -> None:
        self.in_call = True  # the resets drop what a call that raised mid-forward left behind
        for group in self.groups:
            group.reset()
        if self._prefetches and not self._traced:
            self._trace = []
        elif self._prefetch_first and self._first is not None:
            self._first.onload()

    def group_first_used(self, group: ModuleGroup) -> None:
        if self._trace is not None and all(group is not seen for seen in self._trace):
            self._trace.append(group)
        upcoming = self._next_group.get(id(group))
        if upcoming is not None:
            upcoming.onload()  # queued on the side stream; waited for when its module runs

    def end_call(self) -> None:
        self.in_call = False
        for group in self.groups:
            group.reset()
        if self._trace is not None:
            self._next_group = {id(a): b for a, b in zip(self._trace, self._trace[1:])}
            self._first = self._trace[0] if self._trace else None
            self._trace, self._traced = None, True

    def close(self) -> None:
        for group in self.groups:
            group.restore()
        if self.disk_folder is not None:
            shutil.rmtree(self.disk_folder, ignore_errors=True)

    def refresh(self, root: nn.Module) -> Regrouped:
        """Regroup after `root` was edited in place (`regroup`); the prefetch order is traced again."""
        config = self.config
        transfer = self.groups[0].transfer if self.groups else make_transfer(config.onload_device, config.use_stream)

        def new_group(spec: GroupSpec, entries) -> ModuleGroup:
            self._made += 1
            group = _build_group(replace(spec, entries=entries), self._made, config, transfer, self.disk_folder)
            group.take_weights()
            for member in spec.modules:  # a container never runs: its group goes with the layer using it
                add_hook_first(running_ancestor(root, member), GroupOffloadHook(group=group, session=self,
                                                                                is_root=False))
            return group

        result = regroup(root, self.groups, lambda entries: plan_groups(
            root, config.offload_type, config.num_blocks_per_group, entries=entries), new_group)
        unhook_groups(root, result.emptied)
        self.groups = [g for g in self.groups if g.entries] + [group for _, group in result.added]
        _read_ahead_from_disk(self.groups)
        self._trace, self._next_group, self._traced, self._first = None, {}, False, None
        return result


def _read_ahead_from_disk(groups: list[ModuleGroup]) -> None:
    for group in groups:
        group.reads_ahead = group.store.home == "disk"


class GroupMemberHook(ModelHook):
    """Onloads the module's group before its forward, offloads it after; the root hook also runs the session."""

    def __init__(self, *, group: ModuleGroup | None, session: GroupOffloadSession, is_root: bool) -> None:
        self.group = group
        self.session = session
        self.is_root = is_root
        self._entered = False

    @property
    def execution_device(self) -> torch.device:
        return self.session.onload_device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r}, is_root={self.is_root})"

    def pre_forward(self, module, *args, **kwargs):
        if self.is_root:
            self.session.begin_call()
        if self.group is not None:
            if self.group.enter():
                self.session.group_first_used(self.group)
            self.group.wait_until_ready()
            trace.compute_started(module)
        # Where its group was brought: the session's device, or (pooled residency) the GPU whose span it runs in.
        owner = self.group if self.group is not None else self.session
        device, place = owner.onload_device, owner.onload_place
        moved = move_to_device((args, kwargs), device, place)
        self._entered = self.is_root and meter.enter_place(place)
        return moved

    def post_forward(self, module, output):
        if self.group is not None:
            self.group.leave(module)
        if self.is_root:
            self.session.end_call()
        if self._entered:
            meter.leave_place(self.session.onload_place)
            self._entered = False
            output = return_to_caller(output, None, source=self.session.onload_place, target=None)
        return output

    def groups(self) -> list[ModuleGroup]:
        return [*self.session.groups, *([self.group] if self.group is not None else [])]

    def detach_hook(self, module):
        if self.is_root:
            self.session.close()
        elif self.group is not None:
            self.group.restore()
        return module


class GroupOffloadHook(GroupMemberHook):
    technique = Technique.GROUP_OFFLOAD


def apply_group_offloading(
    module: nn.Module, config: GroupOffloadingConfig | None = None, /, **diffusers_keywords
) -> Handle:
    """Group-offload `module` in place (again: replaces it); the handle's `state` is the session. diffusers'
    keyword spelling works too (`group_offloading_fields`)."""
    if not isinstance(config, GroupOffloadingConfig) or diffusers_keywords:
        if isinstance(config, GroupOffloadingConfig):
            raise OffloadConfigError("Pass a GroupOffloadingConfig or diffusers' keywords, not both.")
        config = GroupOffloadingConfig(**group_offloading_fields(config, diffusers_keywords))
    check_compatible(module, SPEC)
    remove_group_offloading(module)
    _refuse_unmaterialized_weights(module)
    if config.onload_device.type == "cuda" and not torch.cuda.is_available():
        raise OffloadConfigError(
            f"onload_device={config.onload_device} but this machine has no CUDA device. "
            "Use onload_device='cpu' (weights then move between the store and the CPU) or run on a GPU machine."
        )
    specs = plan_groups(module, config.offload_type, config.num_blocks_per_group)
    disk_folder = _make_disk_folder(module, config)
    transfer = make_transfer(config.onload_device, config.use_stream)
    groups = [_build_group(spec, index, config, transfer, disk_folder) for index, spec in enumerate(specs)]
    # Groups on disk are read ahead (the next one while one computes) with or without a side stream.
    session = GroupOffloadSession(config=config, groups=groups, prefetches=transfer.prefetches or bool(disk_folder),
                                  disk_folder=disk_folder)
    try:
        for group in groups:
            group.take_weights()
    except BaseException:
        session.close()  # groups that took their weights give them back; the disk folder goes
        raise
    _install_hooks(module, groups, session)
    return Handle(technique=Technique.GROUP_OFFLOAD, module=module, config=config, remover=remove_group_offloading,
                  state=session)


def remove_group_offloading(module: nn.Module) -> None:
    """Remove the group offloading hooks of `module`'s tree; weights go back where they were."""
    if remove_hooks_of_type(module, GroupOffloadHook):
        restore_entry_methods(module)


def group_offloading_session(module: nn.Module) -> GroupOffloadSession | None:
    for hook in hooks_of(module):
        if isinstance(hook, GroupOffloadHook) and hook.is_root:
            return hook.session
    return None


def _install_hooks(root: nn.Module, groups: list[ModuleGroup], session: GroupOffloadSession) -> None:
    # First in each chain: a layerwise-casting hook on the same module must see the onloaded weights.
    root_hook = None
    for group in groups:
        for member in group.modules:
            hook = GroupOffloadHook(group=group, session=session, is_root=member is root)
            root_hook = hook if member is root else root_hook
            add_hook_first(member, hook)
    if root_hook is None:
        root_hook = GroupOffloadHook(group=None, session=session, is_root=True)
        add_hook_first(root, root_hook)
    # A VAE is entered through encode/decode, never its forward: those calls are runs of the root too, so the
    # rest group stays onloaded for the whole call instead of once per module that holds part of it.
    run_entry_methods_through(root, root_hook, nested=lambda: session.in_call)


def _build_group(spec: GroupSpec, index: int, config: GroupOffloadingConfig, transfer, disk_folder):
    if disk_folder is not None:
        file_name = f"{index:04d}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', spec.name)[:80]}.safetensors"
        store = DiskStore(path=os.path.join(disk_folder, file_name))
    else:
        store = HostStore(offload_device=config.offload_device, pin_memory=transfer.uses_pinned_memory)
    return ModuleGroup(spec, store=store, transfer=transfer, onload_device=config.onload_device,
                       onload_place=config.onload_place)


def _make_disk_folder(module: nn.Module, config: GroupOffloadingConfig) -> str | None:
    """A fresh folder per application, so two modules offloaded to one path never overwrite each other."""
    if config.offload_to_disk_path is None:
        return None
    try:
        os.makedirs(config.offload_to_disk_path, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{type(module).__name__}-", dir=config.offload_to_disk_path)
    except OSError as error:
        raise OffloadConfigError(
            f"offload_to_disk_path={config.offload_to_disk_path!r} cannot hold offloaded groups ({error}). "
            "Pass a writable folder."
        ) from error


def group_offloading_fields(positional: Any, keywords: dict[str, Any]) -> dict[str, Any]:
    """The `GroupOffloadingConfig` fields for diffusers' `apply_group_offloading(module, positional, **keywords)`
    (`positional`: its onload_device). `TUNING_ONLY` keywords are accepted and ignored: copies are asynchronous
    exactly when use_stream prefetches; `UNSUPPORTED` ones are an error rather than silently ignored."""
    unknown = sorted(set(keywords) - set(GROUP_OFFLOAD_FIELDS) - set(TUNING_ONLY) - set(UNSUPPORTED))
    if unknown:
        raise OffloadConfigError(
            f"apply_group_offloading got unknown keywords {unknown}; it takes a GroupOffloadingConfig or "
            f"diffusers' keywords {[*GROUP_OFFLOAD_FIELDS, *TUNING_ONLY]}."
        )
    unsupported = sorted(key for key in UNSUPPORTED if keywords.get(key) is not None)
    if unsupported:
        raise OffloadConfigError(
            f"apply_group_offloading: {unsupported} are diffusers options this library does not implement; "
            "leave them out (groups follow the module's block lists; every forward keyword is moved)."
        )
    fields = {key: keywords[key] for key in GROUP_OFFLOAD_FIELDS if keywords.get(key) is not None}
    if positional is not None:
        if "onload_device" in fields:
            raise OffloadConfigError("apply_group_offloading got onload_device twice (by position and keyword).")
        fields["onload_device"] = positional
    if "onload_device" not in fields:
        raise OffloadConfigError(
            "apply_group_offloading needs an onload_device (e.g. onload_device=torch.device('cuda')) or a "
            "GroupOffloadingConfig."
        )
    return fields


def _refuse_unmaterialized_weights(module: nn.Module) -> None:
    on_meta = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise OffloadConfigError(
            f"Cannot group-offload {type(module).__name__}: {len(on_meta)} tensors have no data (meta device), "
            f"e.g. {on_meta[:3]}. Load the weights first (from_pretrained), then offload."
        )


class GroupsEdit:
    """One edit of a module whose weights offload groups hold (`editing`): open offloads every group (edits then
    write into the host store itself) and swaps disk placeholders for stand-ins; `close` regroups."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.stand_ins = StandIns()

    @property
    def groups(self) -> list[ModuleGroup]:
        raise NotImplementedError

    def open(self) -> None:
        groups = self.groups
        for group in groups:
            group.reset()
        names = {id(tensor): name for name, tensor in named_tensors(self.module)}
        for group in groups:
            for entry in group.entries:
                if entry.get().is_meta:
                    self.stand_ins.put(names.get(id(entry.get()), entry.key), entry.slots)

    def homes(self) -> dict[str, Device]:
        """Where each grouped weight rests, by its store (a group loaded for its phase holds device tensors)."""
        names = {id(tensor): name for name, tensor in named_tensors(self.module)}
        return {names.get(id(entry.get()), entry.key): group.store.home_of(entry.key)
                for group in self.groups for entry in group.entries}


class GroupOffloadEdit(GroupsEdit):
    def __init__(self, module: nn.Module, session: GroupOffloadSession) -> None:
        super().__init__(module)
        self.session = session

    @property
    def groups(self) -> list[ModuleGroup]:
        return self.session.groups

    def close(self) -> list[str]:
        problems = self.stand_ins.put_back(self.module)
        self.session.refresh(self.module)
        grouped = {id(entry.get()) for group in self.session.groups for entry in group.entries}
        return problems + [f"{name} (no data: created on meta, nothing serves it)"
                           for name, tensor in named_tensors(self.module) if id(tensor) not in grouped]


def unhook_groups(root: nn.Module, emptied: list[ModuleGroup]) -> None:
    """Take the hooks of `emptied` groups off `root`'s tree; a root hook stays, without a group (it runs the
    session)."""
    gone = {id(group) for group in emptied}
    for member in root.modules():
        for hook in hooks_of(member):
            if isinstance(hook, GroupMemberHook) and id(hook.group) in gone and hook.is_root:
                hook.group = None
        remove_hooks_where(member, lambda hook: isinstance(hook, GroupMemberHook) and id(hook.group) in gone)


def _editor(module: nn.Module) -> GroupOffloadEdit | None:
    session = group_offloading_session(module)
    return None if session is None else GroupOffloadEdit(module, session)


def hooked_group_slots(module: nn.Module, hook_types) -> dict:
    """The placeholders of the groups that the `hook_types` hooks under `module` run (a row's `gather`)."""
    groups = {id(group): group for _, _, hook in find_hooks(module, hook_types) for group in hook.groups()}
    return group_slots(groups.values())


def _plan_config(component: ComponentPlan, context: PlanContext) -> GroupOffloadingConfig:
    # Block level: a whole block per transfer, prefetched on a side CUDA stream from pinned memory, rather
    # than accelerate's per-leaf streaming.
    place = component.execution_device
    return GroupOffloadingConfig(onload_device=place, offload_type=OffloadType.BLOCK_LEVEL,
                                 use_stream=torch_device(place).type == "cuda")


SPEC = register(TechniqueSpec(
    technique=Technique.GROUP_OFFLOAD,
    config_class=GroupOffloadingConfig,
    apply=apply_group_offloading,
    remove=remove_group_offloading,
    refuses={Technique.DEVICE_MAP: "", Technique.MODEL_OFFLOAD: "", Technique.SEQUENTIAL_OFFLOAD: ""},
    offloads_weights=True,
    plan_kinds=frozenset({PlacementKind.OFFLOADED}),
    serves=lambda component, context: streams_everything(component) and not follows_transfer_plan(component, context),
    plan_config=_plan_config,
    # Outputs back where the inputs came from, as for the other placement kinds: a pipeline joining an offloaded
    # encoder's output with a whole one's (SD3's pooled embeddings) gets both on one device.
    finish_plan=lambda module: add_hook_first(module, ReturnOutputsHook()),
    editor=_editor,
    gather=lambda module: hooked_group_slots(module, GroupOffloadHook),
))
