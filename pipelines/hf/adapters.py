"""Adapters (LoRA, ... through peft) on placed pipelines follow their layer: peft creates an adapter's tensors on
the device of the layer's weight, which on a placed component may be a `meta` placeholder (NaN images), so
`follow_adapters` runs each adapter method inside `hooks.edit_placed_weights`. What cannot follow (fusing into
weights read from disk, `set_lora_device`) is refused before anything changes."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from hooks import OffloadConflictError, edit_placed_weights, weight_homes
from hooks.hook_utils import hooks_of

from ..checkpoint import CheckpointShapeError
from ..errors import FolderError

# Methods that edit a module's adapters, on the pipeline (diffusers' LoRA mixins) and on a model (diffusers'
# PeftAdapterMixin, transformers' PeftAdapterMixin). Reading ones are listed too: between calls an offloaded
# adapter is not in its module (save_lora_adapter would read placeholders).
PIPELINE_METHODS = ("load_lora_weights", "unload_lora_weights", "fuse_lora", "unfuse_lora", "set_adapters",
                    "delete_adapters", "enable_lora", "disable_lora")
MODEL_METHODS = ("load_lora_adapter", "unload_lora", "fuse_lora", "unfuse_lora", "set_adapters", "delete_adapters",
                 "add_adapter", "set_adapter", "enable_adapters", "disable_adapters", "enable_lora", "disable_lora",
                 "load_adapter", "delete_adapter", "save_lora_adapter")
FUSING = ("fuse_lora",)
LOADING = ("load_lora_weights", "load_lora_adapter", "load_adapter")
REFUSED = ("set_lora_device",)
_MARK = "_placement_follows_adapters"


def follow_adapters(pipe: Any) -> None:
    """Wrap the adapter methods of `pipe` and of its module components so adapters follow their layer. Idempotent."""
    components = getattr(pipe, "components", {}) or {}
    for name, module in components.items():
        if isinstance(module, nn.Module):
            _wrap_all(module, MODEL_METHODS, lambda args, kwargs, name=name, module=module: {name: module},
                      kinds=_kinds(pipe))
    _wrap_all(pipe, PIPELINE_METHODS, lambda args, kwargs: _loadable(pipe), kinds=_kinds(pipe))


def check_adapter_loads(pipe: Any, names: Iterable[str]) -> None:
    """A pipeline loaded without device_map (and its components `names`, those the load built): its adapter loads
    fail as a placed one's do, the pipeline put back and the file named (`_load_checked`), not with diffusers' or
    peft's raw error. Only the loads are wrapped, by `CheckedAdapterLoad` objects: the pipeline still pickles and
    deep-copies; placing it later wraps these as it wraps diffusers' own methods."""
    owners = [(pipe, ("load_lora_weights",))]
    owners += [(getattr(pipe, name, None), LOADING) for name in names]
    for owner, methods in owners:
        for method in methods:
            if callable(getattr(type(owner), method, None)) and method not in vars(owner):
                setattr(owner, method, CheckedAdapterLoad(owner, method))


class CheckedAdapterLoad:
    """`type(owner).<name>(owner, ...)` through `_load_checked`, with that method's signature. A plain object, not
    a closure, so its owner pickles and deep-copies (as `owner_saving.AtomicSave`)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(getattr(type(self.owner), self.name))
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # without `self`

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = functools.partial(getattr(type(self.owner), self.name), self.owner)
        modules = {type(self.owner).__name__: self.owner} if isinstance(self.owner, nn.Module) else \
            _loadable(self.owner)
        return _load_checked(method, self.name, modules, args, kwargs)


def _wrap_all(owner: Any, names: Iterable[str], touched: Callable, *, kinds: Callable[[], Mapping[str, str]]) -> None:
    for name in (*names, *REFUSED):
        method = getattr(owner, name, None)
        if not callable(method) or getattr(method, _MARK, False):
            continue
        wrapper = _refusing(method, name, touched, kinds) if name in REFUSED else _editing(method, name, touched, kinds)
        setattr(wrapper, _MARK, True)
        setattr(owner, name, wrapper)  # an instance attribute: the class is untouched


def _editing(method, name: str, touched: Callable, kinds: Callable[[], Mapping[str, str]]):
    @functools.wraps(method)
    def edit(*args, **kwargs):
        modules = touched(args, kwargs)
        if name in FUSING:
            _refuse_fusing_disk_weights(name, _fused(modules, args, kwargs), kinds())
        with ExitStack() as stack:
            for label, module in modules.items():
                stack.enter_context(edit_placed_weights(module, what=f"{name}() on {label}"))
                stack.enter_context(_disk_homes_read_as_host(module))
            if name not in LOADING:
                return method(*args, **kwargs)
            return _load_checked(method, name, modules, args, kwargs)

    return edit


@contextmanager
def _disk_homes_read_as_host(module: nn.Module) -> Iterator[None]:
    """Show an adapter load a device map without "disk". transformers' `load_adapter` takes its device map from
    `hf_device_map` and, seeing "disk", prepares disk offload from the adapter's checkpoint files, of which a state
    dict given by diffusers has none (transformers 5.25: IndexError). Inside the edit the disk-homed layers are
    open and new adapter tensors stay in host RAM, where the editor's close leaves them: "cpu" is where they go."""
    device_map = getattr(module, "hf_device_map", None)
    if not isinstance(device_map, dict) or "disk" not in device_map.values():
        yield
        return
    module.hf_device_map = {key: "cpu" if device == "disk" else device for key, device in device_map.items()}
    try:
        yield
    finally:
        module.hf_device_map = device_map


def _load_checked(method, name: str, modules: Mapping[str, nn.Module], args, kwargs):
    """A load of adapters that leaves the pipeline as it was when it fails (peft raises on a wrong shape after
    wrapping the layers); a wrong shape is a `CheckpointShapeError` naming the LoRA, the keys and both shapes, a
    file cut short or keys that adapt no layer a `FolderError` naming it. (A lora_A wider than its FLUX layer is
    diffusers' Control-LoRA expansion, by design.)"""
    before = {label: _AdapterState.of(module) for label, module in modules.items()}
    source = args[0] if args else next((kwargs[key] for key in kwargs if key.startswith("pretrained_model")), None)
    what = f"{str(source)!r}" if isinstance(source, (str, os.PathLike)) else "the state dict given"
    try:
        return method(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - whatever failed, the pipeline is put back first
        for label, module in modules.items():
            before[label].restore(module)
        translated = _adapter_error(error, f"{name}({what})")
        if translated is None:
            raise
        raise translated from error


def _adapter_error(error: Exception, call: str) -> Exception | None:
    """What a failed adapter load says in our words, or None where the owner's error is the clearest."""
    if isinstance(error, FolderError) and str(error).startswith(tuple(f"{name}(" for name in LOADING)):
        return type(error)(f"{call}: {str(error).split(': ', 1)[-1]}")  # a component's own load: say which file
    mismatches = [line.strip().rstrip(".") for line in str(error).splitlines() if "size mismatch" in line]
    if mismatches and isinstance(error, (RuntimeError, ValueError)):
        return CheckpointShapeError(
            f"{call}: the adapter does not fit the layers it adapts: {'; '.join(mismatches[:3])}"
            f"{f' (and {len(mismatches) - 3} more)' if len(mismatches) > 3 else ''}. The pipeline is unchanged; "
            "this adapter was made for another model (or another size of it)."
        )
    reason = " ".join(str(error).split())
    if isinstance(error, OSError) or type(error).__name__ == "SafetensorError":  # diffusers' words for a cut file
        return FolderError(
            f"{call}: the adapter's weights cannot be read ({reason}). The pipeline is unchanged; the file is cut "
            "short, damaged or not a safetensors LoRA: download or save it again."
        )
    if _is_peft_error(error) or (isinstance(error, ValueError) and _NO_LORA_KEYS in reason):
        return FolderError(
            f"{call}: its keys adapt no layer of this pipeline ({type(error).__name__}: {reason}). The pipeline is "
            "unchanged; this adapter was made for another model (check its keys against the model's module names)."
        )
    return None


_NO_LORA_KEYS = "Invalid LoRA checkpoint"  # diffusers 0.42: a state dict none of whose names holds "lora"


def _is_peft_error(error: Exception) -> bool:
    try:
        from peft.utils.error import PeftError
    except ImportError:
        return False
    return isinstance(error, PeftError)


@dataclass(frozen=True, kw_only=True)
class _AdapterState:
    """What a module's adapters were before a load: the names, whether peft had wrapped any layer, and the
    attributes peft and diffusers set on the module."""

    names: frozenset
    wrapped: bool
    attributes: Mapping[str, Any]

    @classmethod
    def of(cls, module: nn.Module) -> "_AdapterState":
        return cls(names=frozenset(getattr(module, "peft_config", None) or {}), wrapped=bool(_tuner_layers(module)),
                   attributes={key: _copied(vars(module)[key]) for key in _PEFT_ATTRIBUTES if key in vars(module)})

    def restore(self, module: nn.Module) -> None:
        """Remove what a load added: its layers' wrappers (when there were none before) or its adapters."""
        added = set(getattr(module, "peft_config", None) or {}) - self.names
        if not self.wrapped:
            from diffusers.utils import recurse_remove_peft_layers

            recurse_remove_peft_layers(module)
        else:
            for layer in _tuner_layers(module).values():
                for adapter in added:
                    layer.delete_adapter(adapter)
        for key in _PEFT_ATTRIBUTES:  # peft edits its dict in place: the copy taken before is put back
            if key in self.attributes:
                setattr(module, key, _copied(self.attributes[key]))
            elif key in vars(module):
                delattr(module, key)


def _copied(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


_PEFT_ATTRIBUTES = ("peft_config", "_hf_peft_config_loaded")


def _tuner_layers(module: nn.Module) -> dict[str, nn.Module]:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return {}
    return {path: layer for path, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)}


def _refusing(method, name: str, touched: Callable, kinds: Callable[[], Mapping[str, str]]):
    @functools.wraps(method)
    def refuse(*args, **kwargs):
        placed = {label: kinds().get(label, "placed") for label, module in touched(args, kwargs).items()
                  if _is_placed(module)}
        if placed:
            raise OffloadConflictError(
                f"{name}(): on a placed pipeline each adapter lives where its layer is placed ({placed}); moving it "
                "would be undone or break the next call. To free an adapter's memory use delete_adapters(name); to "
                "choose devices yourself, call reset_device_map() first."
            )
        return method(*args, **kwargs)

    return refuse


def _fused(modules: Mapping[str, nn.Module], args, kwargs) -> Mapping[str, nn.Module]:
    """The components a fuse call writes into: for the pipeline method, those named by `components`."""
    components = kwargs.get("components", args[0] if args and isinstance(args[0], (list, tuple)) else None)
    if components is None or len(modules) == 1:
        return modules
    return {name: module for name, module in modules.items() if name in components}


def _refuse_fusing_disk_weights(name: str, modules: Mapping[str, nn.Module], kinds: Mapping[str, str]) -> None:
    """Refuse before anything is fused when a layer carrying an adapter has its weights on disk."""
    for label, module in modules.items():
        on_disk = _adapter_layers_on_disk(module)
        if on_disk:
            raise OffloadConflictError(
                f"{name}(): {label} is placed with weights on disk (placement: {kinds.get(label, 'disk')}); "
                f"{len(on_disk)} adapter layer(s) read their weights from the checkpoint files at each forward, "
                f"e.g. {on_disk[:3]}, and fusing would have to rewrite them. The adapter works unfused (applied at "
                "each forward). To fuse it, do so before placing: load without device_map, load_lora_weights(), "
                f"{name}(), save_pretrained(), then load that folder placed; or give {label} room in RAM or on "
                "accelerators (max_memory / device_map)."
            )


def _adapter_layers_on_disk(module: nn.Module) -> list[str]:
    homes = weight_homes(module)
    if "disk" not in homes.values():
        return []
    return [path for path in _tuner_layers(module)
            if any(homes.get(f"{path}.base_layer.{weight}") == "disk" for weight in ("weight", "bias"))]


def _loadable(pipe: Any) -> dict[str, nn.Module]:
    """Its `_lora_loadable_modules` (every module component for a pipeline that does not say)."""
    names = getattr(pipe, "_lora_loadable_modules", None)
    components = getattr(pipe, "components", {}) or {}
    if names is None:
        names = list(components)
    return {name: components[name] for name in names if isinstance(components.get(name), nn.Module)}


def _kinds(pipe: Any) -> Callable[[], Mapping[str, str]]:
    """Each component's placement kind, as the pipeline's plan says (read when an error is written)."""
    def read() -> Mapping[str, str]:
        plan = getattr(pipe, "placement_plan", None)
        return {} if plan is None else {name: component.kind.value for name, component in plan.components.items()}

    return read


def _is_placed(module: nn.Module) -> bool:
    return any(hooks_of(submodule) for submodule in module.modules())


__all__ = ["MODEL_METHODS", "PIPELINE_METHODS", "check_adapter_loads", "follow_adapters"]
