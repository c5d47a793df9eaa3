"""The device-map technique: run a loaded module as `{submodule path: device}` places it, with as few hooks as
that needs. A whole module gets ONE `MoveInputsHook` at its top; a split one also gets one at the top of each
entry that executes where its weights are (accelerate's `dispatch_model(force_hooks=True)` hooks every submodule:
987 on FLUX's transformer, 15-20 us per firing). Streamed entries ("cpu" while an accelerator executes, "disk")
get accelerate's offloading hook on every submodule holding tensors (`ServeWeightsHook`), "disk" weights read
from the checkpoint's own files through an offload index. Buffers are never offloaded (accelerate's default
loses persistent buffers of disk modules). A dispatch that fails removes every hook it attached.

Editing (`DeviceMapEdit`): resident entries need only a check that new tensors sit on their entry's device;
streamed entries put their RAM-served weights back for the edit (a fuse writes into them) and stand-ins for disk
ones, then re-store replaced weights and serve new tensors from host RAM like their neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from accelerate.utils import (OffloadedWeightsLoader, PrefixedDataset, extract_submodules_state_dict,
                              find_tied_parameters, retie_parameters, set_module_tensor_to_device)
from accelerate.utils.modeling import named_module_tensors
from torch import nn

from placement.devices import (Device, check_can_execute, is_accelerator, normalize_device, safetensors_device,
                               torch_device)
from placement.device_maps import flatten_device_map, owning_key
from placement.plan_schema import PlacementKind

from . import transfer_meter as meter
from .errors import OffloadConfigError
from .editing import is_streamed, mapped_homes, settle
from .gather import served_slots, unwrap
from .hook_utils import add_hook_last, find_hooks, has_hook, hooks_of, runs_forward
from .input_moving import MoveInputsHook, glue_parent_forward, move_inputs_of_entry_methods, move_to_device
from .input_moving import remove_glue, restore_entry_methods
from .pinned_files import PinnedWeightsLoader
from .run_timing import remove_run_timing
from .techniques import Handle, Technique, TechniqueConfig, TechniqueSpec, follows_transfer_plan, register
from .techniques import streams_everything
from .tensor_slots import StandIns, TensorSlot

DiskWeights = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True, kw_only=True)
class DeviceMapConfig(TechniqueConfig, technique="a device map", name="DEVICE_MAP"):
    """`dispatch`'s arguments: the relative device map, where streamed parts execute, the "disk" entries' files."""

    device_map: Mapping[str, Device]
    execution_device: Device | None = None
    disk_weights: DiskWeights | None = None


class ServeWeightsHook(AlignDevicesHook):
    """accelerate's offloading `AlignDevicesHook`, moving inputs without copying the caller's lists and counting
    what it serves as weights moved from the host to `place`."""

    def __init__(self, *, place: Device, **accelerate_arguments) -> None:
        super().__init__(**accelerate_arguments)
        self.place = place

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        super().pre_forward(module)  # loads this module's weights onto the execution device
        if meter.metering():
            served = named_module_tensors(module, include_buffers=self.offload_buffers,
                                          recurse=self.place_submodules, remove_non_persistent=True)
            meter.record(meter.Payload.WEIGHTS, sum(meter.tensor_bytes(tensor) for _, tensor in served),
                         source="cpu", target=self.place)
        return move_to_device((args, kwargs), self.execution_device, self.place)


def dispatch(
    module: nn.Module,
    device_map: Mapping[str, Device],
    *,
    execution_device: Device | None = None,
    disk_weights: DiskWeights | None = None,
) -> nn.Module:
    """Attach hooks so `module` runs as `device_map` ({submodule path: device}, "" = whole; the longest prefix
    wins) places it. Weights of resident entries are already on their device; "disk" parameters are on meta and
    served by `disk_weights`. `execution_device` (default: the first accelerator in the map, else "cpu") runs
    the streamed parts. Sets `module.hf_device_map` to the flattened map."""
    normalized = flatten_device_map(module, {name: normalize_device(device) for name, device in device_map.items()})
    _check_complete(module, normalized)
    main = _execution_device(normalized, execution_device)
    disk_index = _disk_index(module, normalized, disk_weights)
    normalized = _place_direct_tensors(module, normalized, main, disk_index)
    try:
        _attach_hooks(module, normalized, main, disk_index)
    except BaseException:
        remove_hook_from_module(module, recurse=True)
        restore_entry_methods(module)
        raise
    module.hf_device_map = dict(normalized)
    return module


def _attach_hooks(module: nn.Module, device_map: Mapping[str, Device], main: Device, disk_index) -> None:
    modules = dict(module.named_modules())
    keys = [key for key in device_map if key in modules]
    streamed = [key for key in keys if is_streamed(device_map[key], main)]
    weights_map = _weights_map(module, [key for key in streamed if device_map[key] == "cpu"], disk_index, main)
    tied_params = find_tied_parameters(module)
    tied_params_map = {tensor.data_ptr(): {} for group in tied_params for name in group
                       if (tensor := module.get_parameter(name)).device.type != "meta"}
    main_device = torch_device(main)
    if "" not in keys or "" in streamed:
        add_hook_to_module(module, MoveInputsHook(main_device, io_same_device=True, place=main))
    if "" in keys:  # no hook below the top catches a call entering through encode/decode
        move_inputs_of_entry_methods(module, main_device, place=main)
    entries = []
    for key in keys:
        if key in streamed:
            serve_weights(modules[key], key, main, weights_map, tied_params_map)
            entries.append(modules[key])
        else:
            device = device_map[key]
            arrive = _inputs_arrive_at(modules[key], key)
            for entry in arrive:
                add_hook_last(entry, MoveInputsHook(torch_device(device), io_same_device=key == "", place=device))
            entries.extend(arrive)
    if "" not in keys and len({d for d in device_map.values() if is_accelerator(d)} | {main}) > 1:
        glue_parent_forward(module, entries)  # its own forward meets tensors from several accelerators
    retie_parameters(module, tied_params)  # offloading tied weights to meta unties them


def _inputs_arrive_at(entry: nn.Module, key: str) -> list[nn.Module]:
    """The modules of a split entry whose inputs may come from another device: the entry (or its called
    children), and its token embeddings, which multimodal parents (Gemma3, Mistral3, Llava) call directly."""
    called = _called_modules(entry)
    if key == "":  # a whole component: its top hook sees every call
        return called
    return called + [m for m in entry.modules() if isinstance(m, nn.Embedding) and not any(m is c for c in called)]


def _called_modules(entry: nn.Module) -> list[nn.Module]:
    """Where an entry's inputs arrive: the entry itself, or for a container that is never called (a ModuleList
    the parent loops over), each child that is (a hook on the container would never fire)."""
    if type(entry).forward is not nn.Module.forward:
        return [entry]
    return [called for child in entry.children() for called in _called_modules(child)]


def _weights_map(module: nn.Module, cpu_keys: list[str], disk_index, main: Device):
    if not cpu_keys and not disk_index:
        return None
    state_dict = None
    if cpu_keys:  # accelerate's extraction matches "key." prefixes: the whole module ("") matches nothing
        state_dict = module.state_dict() if "" in cpu_keys else extract_submodules_state_dict(module.state_dict(),
                                                                                              cpu_keys)
    # Disk tensors are read straight onto the execution device (as accelerate does with an offload index).
    device = safetensors_device(torch_device(main))
    return PinnedWeightsLoader(state_dict=state_dict, index=disk_index, device=device)


def serve_weights(entry: nn.Module, key: str, place: Device, weights_map, tied_params_map) -> None:
    """A `ServeWeightsHook` on every submodule of `entry` holding tensors, and inputs moved at its top."""
    device = torch_device(place)
    if key and not any(True for _ in named_module_tensors(entry, recurse=False)):
        add_hook_last(entry, MoveInputsHook(device, place=place))
    for name, submodule in entry.named_modules():
        if not any(True for _ in named_module_tensors(submodule, recurse=False)):
            continue
        # The component's root may hold tensors of its own (Z-Image's x_pad_token): their names have no prefix.
        prefix = "".join(f"{part}." for part in (key, name) if part)
        serve_from_host(submodule, place, PrefixedDataset(weights_map, prefix) if weights_map is not None else None,
                        tied_params_map)


def serve_from_host(module: nn.Module, place: Device, weights_map=None, tied_params_map=None) -> None:
    """Serve `module`'s own tensors to `place` for each forward, from `weights_map` (None: accelerate copies its
    parameters to host RAM, e.g. an adapter's added to a streamed entry)."""
    add_hook_last(module, ServeWeightsHook(place=place, execution_device=torch_device(place), offload=True,
                                           weights_map=weights_map, offload_buffers=False,
                                           tied_params_map=tied_params_map))


def undispatch(module: nn.Module) -> None:
    """Remove every accelerate hook under `module`; offloaded weights come back as CPU tensors (disk ones too:
    accelerate would leave them on meta), so `.to()` works. Weights on accelerators stay."""
    remove_run_timing(module)  # first: it wraps the entry methods restored below
    for _, submodule, hook in find_hooks(module, AlignDevicesHook):
        _materialize_disk_weights(submodule, hook)
    remove_hook_from_module(module, recurse=True)
    remove_glue(module)
    restore_entry_methods(module)
    if getattr(module, "hf_device_map", None) is not None:
        module.hf_device_map = None


def _check_complete(module: nn.Module, device_map: Mapping[str, Device]) -> None:
    """Every parameter and buffer must be placed by some key (its longest prefix), before any hook goes on."""
    unplaced = [name for name, _ in named_module_tensors(module, include_buffers=True, recurse=True)
                if owning_key(name, device_map) is None]
    if unplaced:
        raise OffloadConfigError(
            f"The device map for {type(module).__name__} places no device for {len(unplaced)} tensor(s), e.g. "
            f"{unplaced[:3]}. Add keys covering them (the key \"\" covers everything not otherwise mapped)."
        )


def _execution_device(device_map: Mapping[str, Device], requested: Device | None) -> Device:
    if requested is not None:
        device = normalize_device(requested)
        check_can_execute(device, what="dispatch(execution_device=...)")
        return device
    accelerators = sorted(d for d in set(device_map.values()) if is_accelerator(d))
    return accelerators[0] if accelerators else "cpu"


def _place_direct_tensors(
    module: nn.Module, device_map: Mapping[str, Device], main: Device, disk_index: DiskWeights | None
) -> dict[str, Device]:
    """Keys naming a tensor rather than a module (a top-level `pos_embed`): accelerate hooks modules only, so
    each is put where it executes (its accelerator, else `main`: one tensor is not worth a hook). Returns the
    map with those keys pointing where their tensor now is."""
    modules = dict(module.named_modules())
    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    unknown = [key for key in device_map if key not in modules and key not in tensors]
    if unknown:
        raise OffloadConfigError(
            f"device_map keys {unknown} name neither a submodule nor a tensor of {type(module).__name__}; "
            f"its top-level names are {[name for name, _ in module.named_children()]}. Use paths from "
            "named_modules()."
        )
    placed = dict(device_map)
    served = PinnedWeightsLoader(index=disk_index) if disk_index else {}
    for key, device in device_map.items():
        if key in modules:
            continue
        target = device if is_accelerator(device) else main
        value = served[key] if tensors[key].device.type == "meta" and key in served else tensors[key]
        if value.device.type == "meta":
            raise OffloadConfigError(f"{key!r} is on meta and no disk_weights entry serves it: load it first.")
        set_module_tensor_to_device(module, key, torch_device(target), value=value, dtype=value.dtype)
        placed[key] = target
    return placed


def _disk_index(module: nn.Module, device_map: Mapping[str, Device], disk_weights: DiskWeights | None):
    disk_prefixes = [name for name, device in device_map.items() if device == "disk"]
    if not disk_prefixes:
        return None
    parameters = [name for name, _ in module.named_parameters() if owning_key(name, disk_prefixes) is not None]
    unserved = [name for name in parameters if disk_weights is None or name not in disk_weights]
    if unserved:
        raise OffloadConfigError(
            f"The device map puts {', '.join(repr(p) for p in disk_prefixes)} on 'disk', but no disk_weights "
            f"entry serves {len(unserved)} of their parameters (e.g. {unserved[0]!r}). Pass the checkpoint's "
            "offload index (WeightsIndex.offload_index) as disk_weights."
        )
    return {name: dict(info) for name, info in disk_weights.items()}


def _materialize_disk_weights(submodule: nn.Module, hook: AlignDevicesHook) -> None:
    if not hook.offload or hook.weights_map is None:
        return
    meta = torch.device("meta")
    for name, original in getattr(hook, "original_devices", {}).items():
        if original != meta:
            continue  # accelerate's detach_hook restores weights that had a real device
        try:
            value = hook.weights_map[name].to("cpu")
        except KeyError:
            continue  # not served by the hook (e.g. a buffer): left as it is
        set_module_tensor_to_device(submodule, name, "cpu", value=value, dtype=value.dtype)


def apply_device_map(module: nn.Module, config: DeviceMapConfig) -> Handle:
    """`dispatch` with the config's fields; the handle's `remove()` is `undispatch`."""
    dispatch(module, config.device_map, execution_device=config.execution_device, disk_weights=config.disk_weights)
    return Handle(technique=Technique.DEVICE_MAP, module=module, config=config, remover=undispatch)


class DeviceMapEdit:
    """One edit of a dispatched module (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        device_map = getattr(module, "hf_device_map", None)
        self.device_map = dict(device_map) if isinstance(device_map, dict) else {"": "cpu"}
        self.main = execution_place_of(module)
        self.stand_ins = StandIns()
        # (slot, (the hook's store, key there), the tensor put in, the data pointer of its home)
        self._homed: list[tuple[TensorSlot, Any, torch.Tensor, int]] = []

    def open(self) -> None:
        for path, submodule, hook in find_hooks(self.module, ServeWeightsHook):
            for name, _ in named_module_tensors(submodule, include_buffers=hook.offload_buffers,
                                                recurse=hook.place_submodules, remove_non_persistent=True):
                slot = TensorSlot(module=submodule, name=name, is_parameter=name in submodule._parameters)
                store, key = _store_of(hook.weights_map, name)
                home = store.get(key) if store is not None else None
                if home is None:
                    self.stand_ins.put(f"{path}.{name}" if path else name, [slot])
                    continue
                placeholder = slot.get()
                value = nn.Parameter(home, requires_grad=placeholder.requires_grad) if slot.is_parameter else home
                slot.holder[name] = value
                self._homed.append((slot, (store, key), value, home.data_ptr()))

    def close(self) -> list[str]:
        problems = self.stand_ins.put_back(self.module)
        for slot, (store, key), put, home_pointer in self._homed:
            held = slot.get()
            if held is not put or held.data_ptr() != home_pointer:
                store[key] = held.detach().to("cpu")  # replaced (e.g. `weight.data = merged`): store the new one
            placeholder = torch.empty_like(held, device="meta")
            slot.holder[slot.name] = nn.Parameter(placeholder, requires_grad=held.requires_grad) \
                if slot.is_parameter else placeholder
        self._homed = []
        return problems + self._serve_new()

    def _serve_new(self) -> list[str]:
        served = {id(tensor) for _, submodule, hook in find_hooks(self.module, ServeWeightsHook)
                  for _, tensor in named_module_tensors(submodule, recurse=hook.place_submodules)}
        streamed, no_data = settle(self.module, self.device_map, self.main, served)
        for path, submodule in streamed:
            if any(tensor.is_meta for tensor in submodule.parameters(recurse=False)):
                continue  # reported in no_data: nothing holds its values
            if runs_forward(submodule):
                serve_from_host(submodule, self.main)
            else:
                for name, _ in named_module_tensors(submodule, include_buffers=True, recurse=False):
                    set_module_tensor_to_device(submodule, name, torch_device(self.main))
        return [f"{name} (no data: created on meta, nothing serves it)" for name in no_data]

    def homes(self) -> dict[str, Device]:
        found: dict[str, Device] = {}
        mapped = mapped_homes(self.module, self.device_map)
        for path, submodule in self.module.named_modules():
            prefix = f"{path}." if path else ""
            hooks = [hook for hook in hooks_of(submodule) if isinstance(hook, ServeWeightsHook)]
            for name, tensor in named_module_tensors(submodule, recurse=False):
                if hooks:
                    store, key = _store_of(hooks[0].weights_map, name)
                    found[prefix + name] = "cpu" if store is not None and key in store else "disk"
                else:  # in a streamed entry without a hook: kept where it runs (see _serve_new)
                    home = mapped.get(id(tensor), "cpu")
                    found[prefix + name] = self.main if is_streamed(home, self.main) else home
        return found


def execution_place_of(module: nn.Module) -> Device:
    for hook in hooks_of(module):
        if isinstance(hook, MoveInputsHook):
            return hook.place
    return "cpu"


def _store_of(weights_map, name: str):
    """(the in-memory mapping that may hold `name`'s served value, its key there); (None, None) when values are
    read from files."""
    base, key = unwrap(weights_map, name)
    if isinstance(base, OffloadedWeightsLoader):
        base = base.state_dict
    return (base, key) if isinstance(base, dict) else (None, None)


def device_map_editor(module: nn.Module) -> DeviceMapEdit | None:
    if any(isinstance(hook, MoveInputsHook) for hook in hooks_of(module)) or has_hook(module, ServeWeightsHook):
        return DeviceMapEdit(module)
    return None


SPEC = register(TechniqueSpec(
    technique=Technique.DEVICE_MAP,
    config_class=DeviceMapConfig,
    apply=apply_device_map,
    remove=undispatch,
    refuses={},  # the loader applies a placement to fresh modules; it replaces nothing
    offloads_weights=False,  # streamed entries aside, weights are where the map says; pipelines refuse .to()
    plan_kinds=frozenset(PlacementKind),
    serves=lambda component, context: (not follows_transfer_plan(component, context)
                                       and not streams_everything(component)),
    plan_config=lambda component, context: DeviceMapConfig(
        device_map=component.device_map, execution_device=component.execution_device,
        disk_weights=context.disk_weights),
    editor=device_map_editor,
    gather=served_slots,
))

__all__ = ["SPEC", "DeviceMapConfig", "DeviceMapEdit", "DiskWeights", "ServeWeightsHook", "apply_device_map",
           "device_map_editor", "dispatch", "execution_place_of", "serve_from_host", "serve_weights", "undispatch"]
