"""The runtime techniques, and which ones refuse to be mixed with which: one table, one `check_compatible`.

Each technique installs accelerate `ModelHook`s on a module tree. Two of them fighting over the same weights
(group offloading on top of accelerate's own offloading, sequential offload over layerwise casting, ...) would
silently waste memory or compute in the wrong dtype, so applying a technique first asks `check_compatible`,
which finds the techniques already on the tree and raises `OffloadConflictError` for any pair the table
refuses, saying where the other technique sits and how to remove it.

Our hook classes name their technique in a `technique` class attribute; accelerate's own hooks are recognised
by type (`CpuOffload`: model offload; `AlignDevicesHook` that offloads or only moves inputs: sequential offload;
one with an execution device: a device map). This file imports no technique, so none imports another.
"""

from __future__ import annotations

from enum import Enum

from accelerate.hooks import AlignDevicesHook, CpuOffload, ModelHook
from torch import nn

from .hook_utils import hooks_of
from .memory_errors import OffloadConflictError


class Technique(str, Enum):
    DEVICE_MAP = "a device map"
    MODEL_OFFLOAD = "model offload"
    SEQUENTIAL_OFFLOAD = "sequential offload"
    GROUP_OFFLOAD = "group offloading"
    LAYERWISE_CASTING = "layerwise casting"


# applying -> the techniques already on the tree that it refuses (the others combine).
REFUSES: dict[Technique, frozenset[Technique]] = {
    Technique.MODEL_OFFLOAD: frozenset({Technique.DEVICE_MAP, Technique.SEQUENTIAL_OFFLOAD, Technique.GROUP_OFFLOAD}),
    Technique.SEQUENTIAL_OFFLOAD: frozenset(
        {Technique.DEVICE_MAP, Technique.MODEL_OFFLOAD, Technique.GROUP_OFFLOAD, Technique.LAYERWISE_CASTING}
    ),
    Technique.GROUP_OFFLOAD: frozenset({Technique.DEVICE_MAP, Technique.MODEL_OFFLOAD, Technique.SEQUENTIAL_OFFLOAD}),
    Technique.LAYERWISE_CASTING: frozenset({Technique.SEQUENTIAL_OFFLOAD, Technique.GROUP_OFFLOAD}),
}

# Why a pair cannot mix, where the general "they would fight over its weights" says too little.
_WHY: dict[tuple[Technique, Technique], str] = {
    (Technique.SEQUENTIAL_OFFLOAD, Technique.LAYERWISE_CASTING): (
        "sequential offload restores each layer from its own full-precision state dict before the cast hook runs, "
        "so the casting would be bypassed. Use group offloading with offload_type='leaf_level' instead (it keeps "
        "the stored dtype), or model offload"
    ),
    (Technique.LAYERWISE_CASTING, Technique.SEQUENTIAL_OFFLOAD): (
        "its weights come back from a full-precision state dict on every call, so casting would save nothing. "
        "Casting combines with group offloading (applied after casting) and model offload"
    ),
    (Technique.LAYERWISE_CASTING, Technique.GROUP_OFFLOAD): (
        "apply layerwise casting first, then group offloading (remove_group_offloading(module), "
        "apply_layerwise_casting(...), apply_group_offloading(...))"
    ),
}

_REMOVE: dict[Technique, str] = {
    Technique.DEVICE_MAP: "hooks.dispatch.undispatch(module)",
    Technique.MODEL_OFFLOAD: "hooks.remove_model_cpu_offload(module)",
    Technique.SEQUENTIAL_OFFLOAD: "hooks.remove_sequential_cpu_offload(module)",
    Technique.GROUP_OFFLOAD: "hooks.remove_group_offloading(module)",
    Technique.LAYERWISE_CASTING: "hooks.remove_layerwise_casting(module)",
}


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


def check_compatible(module: nn.Module, applying: Technique) -> None:
    """Raise `OffloadConflictError` if `module`'s tree carries a technique that `applying` refuses."""
    present = techniques_on(module)
    for other in sorted(REFUSES[applying] & present.keys(), key=list(Technique).index):
        why = _WHY.get((applying, other), "the two would fight over its weights")
        raise OffloadConflictError(
            f"Cannot apply {applying.value} to {type(module).__name__}: it already has {other.value} (hooks at "
            f"{present[other]!r}); {why}. Remove it first ({_REMOVE[other]}; on a pipeline: reset_device_map())."
        )


__all__ = ["REFUSES", "Technique", "check_compatible", "technique_of", "techniques_on"]
