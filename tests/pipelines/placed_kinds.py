"""Plans that place chosen components of a pipeline in each placement kind, for the tests of what works on a placed
pipeline (saving, reset). Importable as `placed_kinds`.

`kind_plan(base, modules, kind, parts)` returns `base` (a plan of the pipeline's folder, e.g. from
`plan_placement`) with every component named in `parts` placed as `kind`; `parts[name]` names two submodules
holding weights (`a`, `b`), which split, partly CPU-served and per-call plans put elsewhere. Loading the folder
with `device_map=` that plan follows it as it is (over two virtual accelerators):

    whole       {"": 1}                                    one input-moving hook
    split       {"": 0, a: 1}                              a hook per entry
    offloaded   {"": "cpu"}, executed on 0                 group offloading from CPU RAM
    cpu_served  {"": 0, a: "cpu"}, executed on 0           a's weights served by hooks from a CPU state dict
    cpu         {"": "cpu"}, executed on the CPU
    disk        {"": "disk"}, executed on 0                served from the checkpoint's own files
    per_call    {"": 0, a: "cpu", b: "disk"}, a per call, b streamed: per-call residency (b from the checkpoint)
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from placement.device_maps import owning_key, tensor_devices
from placement.devices import is_accelerator
from placement.plan_schema import ComponentTransfer, PlacementKind, Plan

KINDS = ("whole", "split", "offloaded", "cpu_served", "cpu", "disk", "per_call")


def layout(kind: str, a: str, b: str) -> dict:
    """kind -> the ComponentPlan fields that place a component so (see the module docstring)."""
    offloaded = PlacementKind.OFFLOADED
    return {
        "whole": dict(kind=PlacementKind.WHOLE, device_map={"": 1}, execution_device=1),
        "split": dict(kind=PlacementKind.SPLIT, device_map={"": 0, a: 1}, execution_device=0),
        "offloaded": dict(kind=offloaded, device_map={"": "cpu"}, execution_device=0),
        "cpu_served": dict(kind=offloaded, device_map={"": 0, a: "cpu"}, execution_device=0),
        "cpu": dict(kind=PlacementKind.CPU, device_map={"": "cpu"}, execution_device="cpu"),
        "disk": dict(kind=PlacementKind.DISK, device_map={"": "disk"}, execution_device=0),
        "per_call": dict(kind=offloaded, device_map={"": 0, a: "cpu", b: "disk"}, execution_device=0,
                         per_call=(a,), streamed=(b,)),
    }[kind]


def kind_plan(base: Plan, modules: Mapping[str, nn.Module], kind: str, parts: Mapping[str, tuple[str, str]]) -> Plan:
    components = dict(base.components)
    for name, (a, b) in parts.items():
        fields = layout(kind, a, b)
        per_call, streamed = fields.pop("per_call", ()), fields.pop("streamed", ())
        sizes = {key: t.numel() * t.element_size() for key, t in modules[name].state_dict().items()}
        placed: dict = {}
        for key, home in tensor_devices(modules[name], fields["device_map"]).items():
            placed[home] = placed.get(home, 0) + sizes.get(key, 0)
        transfer = None
        if per_call or streamed:
            def under(paths):
                return sum(size for key, size in sizes.items() if any(owning_key(key, [p]) for p in paths))
            transfer = ComponentTransfer(
                resident_bytes=sum(size for device, size in placed.items() if is_accelerator(device)),
                loaded_per_call_bytes=under(per_call), streamed_per_run_bytes=under(streamed),
                per_call_modules=list(per_call), streamed_modules=list(streamed))
        components[name] = base.components[name].model_copy(update=dict(
            devices=sorted(placed, key=str), placed_bytes=placed, transfer=transfer, **fields))
    return base.model_copy(update=dict(components=components))


def hooks_and_placeholders(pipe_modules: Mapping[str, nn.Module]) -> dict:
    """What a placement consists of, to compare before and after an operation that must not change it: each
    module's hook types, and which tensors are placeholders (meta) or on which device."""
    state = {}
    for name, module in pipe_modules.items():
        for path, submodule in module.named_modules():
            hook = getattr(submodule, "_hf_hook", None)
            if hook is not None:
                state[f"{name}.{path}:hook"] = type(hook).__name__
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            state[f"{name}.{key}"] = str(tensor.device)
        state[f"{name}:map"] = getattr(module, "hf_device_map", "absent")
    return state
