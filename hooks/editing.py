"""Edit a placed module in place (adapters loaded, fused, unloaded) and keep its placement serving it.

    with hooks.edit_placed_weights(pipe.transformer):
        pipe.transformer.load_lora_adapter(...)

peft creates new tensors beside the weights it wraps, on their device; on a placed module those may wait in host
RAM or on disk (`meta`), and the runtime's bookkeeping predates the new tensors. So the editor of the technique
whose hooks sit highest (its row's `editor`) opens the module (home forms in place, disk ones as stand-ins) and
closes it (new tensors follow their layer, removed ones are forgotten); what cannot be followed raises
`OffloadConflictError` once the module is consistent again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from accelerate.utils import set_module_tensor_to_device
from torch import nn

from placement.device_maps import owning_key
from placement.devices import Device, is_accelerator, torch_device

from .errors import OffloadConflictError
from .guidance_parallel import ReplicaEditor, branching
from .hook_utils import add_hook_last, find_hooks, hooks_of
from .input_moving import MoveInputsHook, is_on
from .techniques import TECHNIQUES, techniques_on
from .tensor_slots import direct_slots, named_tensors
from .transfer_meter import place_of_device

_EDITING: set[int] = set()  # ids of the modules inside an edit (a nested edit of one module is the same edit)


@contextmanager
def edit_placed_weights(module: nn.Module, *, what: str = "the edit") -> Iterator[None]:
    """Run the body as an edit of `module`'s tensors that its placement follows; `what` names it in errors."""
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
    """Make the placement serve `module` as it is now, after an edit made outside `edit_placed_weights`."""
    with edit_placed_weights(module, what="an earlier edit"):
        pass


def weight_homes(module: nn.Module) -> dict[str, Device]:
    """Where each of `module`'s weights lives between calls, by qualified name: an accelerator index, "cpu"
    (host RAM: offloaded, served, or the CPU placement) or "disk"."""
    homes: dict[str, Device] = {}
    for editor in _editors(module):
        homes.update(editor.homes())
    if not homes:
        homes = {name: place_of_device(t.device) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    return homes


def _editors(module: nn.Module) -> list:
    """The input-moving hooks' follower, and the editor of the technique whose hooks sit highest (ties: table
    order)."""
    editors: list = [WrappedLayers(module)]
    if branching(module) is not None:  # last to close: its replica is rebuilt from the edited module
        editors.insert(0, ReplicaEditor(module))
    present = techniques_on(module)
    order = list(TECHNIQUES)
    for technique in sorted(present, key=lambda t: (_depth(present[t]), order.index(t))):
        row = TECHNIQUES[technique]
        editor = row.editor(module) if row.editor is not None else None
        if editor is not None:
            editors.append(editor)
            break
    return editors


def _depth(path: str) -> int:
    return 0 if path == "<root>" else path.count(".") + 1


class WrappedLayers:
    """A layer an edit wraps (peft's LoRA layer holds it as `base_layer`) passes its input-moving hook to the
    wrapper, whose own branch reads the input before the wrapped layer's hook moves it."""

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


def settle(root: nn.Module, device_map: Mapping[str, Device], main: Device, covered: set[int]) -> tuple[
        list[tuple[str, nn.Module]], list[str]]:
    """Put each tensor no technique serves (`covered`: ids of the served ones) on its resident entry's device.
    Returns the modules holding such tensors in streamed entries, for the caller to serve, and the names of
    tensors with no data (meta) and nothing serving them."""
    streamed: list[tuple[str, nn.Module]] = []
    no_data: list[str] = []
    mapped = mapped_homes(root, device_map)
    for path, module in root.named_modules():
        direct = [(slot.name, tensor) for slot, tensor in direct_slots(module) if id(tensor) not in covered]
        if not direct:
            continue
        prefix = f"{path}." if path else ""
        homes = {name: mapped.get(id(tensor), device_map.get("", "cpu")) for name, tensor in direct}
        no_data += [prefix + name for name, tensor in direct if tensor.is_meta]
        if any(is_streamed(home, main) for home in homes.values()):
            streamed.append((path, module))
            continue
        for name, tensor in direct:
            device = torch_device(homes[name])
            if not tensor.is_meta and not is_on(tensor, device):
                set_module_tensor_to_device(module, name, device)
    return streamed, no_data


def is_streamed(home: Device, main: Device) -> bool:
    """Weights homed off the executing device: on disk, or in RAM while an accelerator executes."""
    return home == "disk" or (home == "cpu" and is_accelerator(main))


def mapped_homes(root: nn.Module, device_map: Mapping[str, Device]) -> dict[int, Device]:
    """Each tensor's device-map home, by identity: a tied tensor (T5's `encoder.embed_tokens` is `shared`) is
    homed by whichever of its names the map covers."""
    homes: dict[int, Device] = {}
    for name, tensor in named_tensors(root):
        key = owning_key(name, device_map)
        if key is not None:
            homes.setdefault(id(tensor), device_map[key])
    return homes


__all__ = ["edit_placed_weights", "is_streamed", "mapped_homes", "refresh_placement", "settle", "weight_homes"]
