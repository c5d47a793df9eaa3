"""Editing a module run by per-call residency (`residency`): its per-call and streamed units are offload groups.

For an edit every unit is offloaded (per-call units kept on the accelerator across calls go back to the host:
the next call loads them again, as after a release), so the module holds each weight's host form, disk-homed
ones as stand-ins. Afterwards the units are regrouped (`group_offload.regroup`) by the component's own lists:
a LoRA inside a per-call block joins that block, one inside a streamed block moves with it at every run;
tensors of resident entries stay on their accelerator (moved there if an edit left them elsewhere). The
phase's byte counts follow, so the coordinator makes room for what the component now loads.
"""

from __future__ import annotations

from torch import nn

from placement.devices import Device, normalize_device
from placement.streaming import block_groups

from .edit_support import mapped_homes, named_tensors, open_groups, settle, store_home
from .group_offload.grouping import GroupSpec
from .group_offload.module_group import ModuleGroup, ReleaseRule
from .group_offload.regroup import regroup
from .group_offload.transfer import BlockingTransfer
from .hook_utils import add_hook_first, hooks_of, remove_hooks_where
from .residency import ComponentPhase, ResidencyHook, StreamedBlockHook, _group, _specs
from .stand_ins import StandIns


class ResidencyEdit:
    """One edit of a module under per-call residency (see the module docstring)."""

    def __init__(self, module: nn.Module, phase: ComponentPhase) -> None:
        self.module = module
        self.phase = phase
        self.stand_ins = StandIns()
        self.kinds: dict[int, tuple[str, Device]] = {}  # id(spec) -> its list, and the device it loads onto

    @property
    def groups(self) -> list[ModuleGroup]:
        session = self.phase.session
        return [*self.phase.per_call, *self.phase.per_run, *(session.groups if session is not None else [])]

    def open(self) -> None:
        open_groups(self.module, self.groups, self.stand_ins)

    def close(self) -> list[str]:
        problems = [f"{name} (its weights are on disk; the edit tried to change them)"
                    for name in self.stand_ins.put_back(self.module)]
        phase, config = self.phase, self.phase.config
        away = {path: normalize_device(device) for path, device in config.per_call_devices.items()}

        def specs_for(entries):
            block_paths = block_groups(self.module).block_paths
            for kind, paths in (("per_call", config.per_call_modules), ("streamed", config.streamed_modules)):
                for path in paths:
                    for spec in _specs(self.module, path, block_paths, entries):
                        onto = away.get(path, phase.place) if kind == "per_call" else phase.place
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
        elif group.release is ReleaseRule.AFTER_LAST_MODULE and phase.session is not None:
            phase.session.groups.append(group)
            for member in group.modules:
                add_hook_first(member, StreamedBlockHook(group=group, session=phase.session, is_root=False))
        else:
            phase.per_run.append(group)

    def _drop(self, emptied: list[ModuleGroup]) -> None:
        phase = self.phase
        gone = {id(group) for group in emptied}
        for member in self.module.modules():
            remove_hooks_where(member, lambda hook: isinstance(hook, StreamedBlockHook) and id(hook.group) in gone)
        for share in phase.shares.values():
            share.per_call[:] = [group for group in share.per_call if group.entries]
        phase.per_run[:] = [group for group in phase.per_run if group.entries]
        if phase.session is not None:
            phase.session.groups[:] = [group for group in phase.session.groups if group.entries]

    def homes(self) -> dict[str, Device]:
        names = {id(tensor): name for name, tensor in named_tensors(self.module)}
        found = {name: home for name, home in _resident_homes(self.module).items()}
        for group in self.groups:
            for entry in group.entries:
                found[names.get(id(entry.get()), entry.key)] = store_home(group, entry)
        return found


def residency_phase(module: nn.Module) -> ComponentPhase | None:
    """The phase of the per-call residency applied to `module` itself (None: none is)."""
    for hook in hooks_of(module):
        if isinstance(hook, ResidencyHook):
            return hook.phase
    return None


def _resident_homes(module: nn.Module) -> dict[str, Device]:
    mapped = mapped_homes(module, dict(module.hf_device_map))
    return {name: mapped.get(id(tensor), "cpu") for name, tensor in named_tensors(module)}


__all__ = ["ResidencyEdit", "residency_phase"]
