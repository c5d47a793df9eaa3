"""Edit a placed module in place (adapters loaded, fused, unloaded) and keep its placement serving it.

    with hooks.edit_placed_weights(pipe.transformer):
        pipe.transformer.load_lora_adapter(...)        # or fuse_lora(), unload_lora(), delete_adapters(...)
    hooks.weight_homes(pipe.transformer)                # {"...to_q.lora_A.default.weight": "cpu", ...}

Code that edits a module (peft) creates new tensors beside the weights it wraps, on their device, and writes
merged weights into them. On a placed module those weights may not be where the layer runs: they may wait in
host RAM (offloaded, per-call, streamed) or on disk (`meta` placeholders, read at each forward), and the
runtime's bookkeeping (offload groups, served weights) was made before the new tensors existed. So an edit
runs inside `edit_placed_weights`, which gives every technique on the module a chance to open and close it:
- open: the module holds each weight's home form: groups offloaded, RAM-served weights put back, disk ones as
  stand-ins (`stand_ins`: new tensors land in host RAM; a write to the disk copy is refused);
- close: new tensors follow their layer (its device for whole/split/cpu entries; its offload group, its
  streamed entry's served set, its per-call or streamed unit otherwise), removed ones are forgotten, replaced
  ones re-stored; input-moving hooks of layers that were wrapped move up to the wrapper.
What cannot be followed raises `OffloadConflictError` naming the tensors, after the module is consistent again:
a write to disk-homed weights (their new values are dropped; the checkpoint's serve the layer), tensors with
no data. The editors are found by the hooks on the module (`dispatch_edit`, `residency_edit`, group
offloading's `refresh`); a module without placement hooks is edited as it is. Nested edits of one module
are one edit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from placement.devices import Device

from .dispatch import ServeWeightsHook
from .dispatch_edit import DeviceMapEdit
from .edit_support import named_tensors, open_groups, store_home
from .errors import OffloadConflictError
from .group_offload.offload import GroupOffloadSession, group_offloading_session
from .hook_utils import add_hook_last, find_hooks, hooks_of
from .input_moving import MoveInputsHook
from .residency_edit import ResidencyEdit, residency_phase
from .stand_ins import StandIns


_EDITING: set[int] = set()  # ids of the modules inside an edit (a nested edit of one module is the same edit)


@contextmanager
def edit_placed_weights(module: nn.Module, *, what: str = "the edit") -> Iterator[None]:
    """Run the body as an edit of `module`'s tensors that its placement follows (see the module docstring);
    `what` names the edit in errors. Raises `OffloadConflictError` (after closing) for what cannot be followed."""
    if id(module) in _EDITING:
        yield
        return
    editors = _editors(module)
    _EDITING.add(id(module))
    try:
        for editor in editors:
            editor.open()
        yield
    finally:
        _EDITING.discard(id(module))
        problems = [problem for editor in reversed(editors) for problem in editor.close()]
    if problems:
        raise OffloadConflictError(
            f"{type(module).__name__}: {what} left {len(problems)} tensor(s) its placement cannot serve: "
            f"{problems[:4]}. Weights read from disk cannot change: place the module in RAM or on accelerators "
            "(device_map / reset_device_map()), or make the change before placing it."
        )


def refresh_placement(module: nn.Module) -> None:
    """Make the placement serve `module` as it is now, after an edit made outside `edit_placed_weights`: new
    tensors follow their layer, removed ones are forgotten. (Tensors created beside disk-homed weights
    outside an edit have no data: that is reported.)"""
    with edit_placed_weights(module, what="an earlier edit"):
        pass


def weight_homes(module: nn.Module) -> dict[str, Device]:
    """Where each of `module`'s weights lives between calls, by qualified name: an accelerator index, "cpu"
    (host RAM: offloaded, served, or the CPU placement) or "disk"."""
    homes: dict[str, Device] = {}
    for editor in _editors(module):
        homes.update(editor.homes())
    if not homes:
        homes = {name: "cpu" if t.device.type in ("cpu", "meta") else (t.device.index or 0)
                 for name, t in [*module.named_parameters(), *module.named_buffers()]}
    return homes


def _editors(module: nn.Module) -> list:
    editors: list = [WrappedLayers(module)]
    session = group_offloading_session(module)
    phase = residency_phase(module)
    if session is not None:
        editors.append(GroupOffloadEdit(module, session))
    elif phase is not None:
        editors.append(ResidencyEdit(module, phase))
    elif any(isinstance(hook, MoveInputsHook) for hook in hooks_of(module)) or \
            next(find_hooks(module, ServeWeightsHook), None) is not None:
        editors.append(DeviceMapEdit(module))
    return editors


class GroupOffloadEdit:
    """One edit of a group-offloaded module: groups offloaded (disk ones as stand-ins), then regrouped."""

    def __init__(self, module: nn.Module, session: GroupOffloadSession) -> None:
        self.module = module
        self.session = session
        self.stand_ins = StandIns()

    def open(self) -> None:
        open_groups(self.module, self.session.groups, self.stand_ins)

    def close(self) -> list[str]:
        problems = [f"{name} (its weights are on disk; the edit tried to change them)"
                    for name in self.stand_ins.put_back(self.module)]
        self.session.refresh(self.module)
        grouped = {id(entry.get()) for group in self.session.groups for entry in group.entries}
        return problems + [f"{name} (no data: created on meta, nothing serves it)"
                           for name, tensor in named_tensors(self.module) if id(tensor) not in grouped]

    def homes(self) -> dict[str, Device]:
        names = {id(tensor): name for name, tensor in named_tensors(self.module)}
        return {names.get(id(entry.get()), entry.key): store_home(group, entry)
                for group in self.session.groups for entry in group.entries}


class WrappedLayers:
    """Input-moving hooks follow their layer when an edit wraps it (peft puts a LoRA layer where the layer was,
    holding it as `base_layer`): the wrapper's own branch reads the input before the wrapped layer's hook moves
    it, so the wrapper gets the same hook."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._hooked: list[tuple[str, nn.Module, MoveInputsHook]] = []

    def open(self) -> None:
        self._hooked = [(path, layer, hook) for path, layer, hook in find_hooks(self.module, MoveInputsHook) if path]

    def close(self) -> list[str]:
        for path, layer, hook in self._hooked:
            try:
                current = self.module.get_submodule(path)
            except AttributeError:
                continue
            wrapped = current is not layer and any(inner is layer for inner in current.modules())
            if wrapped and not any(isinstance(other, MoveInputsHook) for other in hooks_of(current)):
                add_hook_last(current, MoveInputsHook(hook.execution_device, place=hook.place))
        return []

    def homes(self) -> dict[str, Device]:
        return {}


__all__ = ["edit_placed_weights", "refresh_placement", "weight_homes"]
