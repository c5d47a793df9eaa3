"""Input-moving hooks for a component passed in already placed (pinned where its own `hf_device_map` says).

Its owner placed it, so its weights are never moved. But transformers' and diffusers' `from_pretrained` place
a one-device map (`device_map={"": 1}`) with no hook at all, and a diffusers pipeline sends every component
its inputs on the pipeline's execution device: the component's embedding on GPU 1 would meet input ids on
GPU 0 ("Expected all tensors to be on the same device"). Such a component gets the hooks its map calls for
(one at the top for one device), as the components we load get; one that carries hooks (accelerate's
`dispatch_model` over several devices) keeps its owner's. Undoing removes our hooks and keeps the owner's map.
"""

from __future__ import annotations

from torch import nn

from hooks.dispatch import undispatch
from hooks.techniques import apply_component_plan
from placement.plan_schema import ComponentPlan


def hook_inputs_of_pinned(module: nn.Module, component: ComponentPlan) -> bool:
    """Attach input-moving hooks to an unhooked pinned component; whether it did."""
    if any(hasattr(submodule, "_hf_hook") for submodule in module.modules()):
        return False
    owner_map = getattr(module, "hf_device_map", None)  # None: pinned on request (`pin=`), with no map of its own
    apply_component_plan(module, component)
    if owner_map is not None:
        module.hf_device_map = owner_map
    return True


def unhook_pinned(module: nn.Module) -> None:
    """Remove the hooks `hook_inputs_of_pinned` attached; the weights and the owner's map stay."""
    owner_map = getattr(module, "hf_device_map", None)
    undispatch(module)
    module.hf_device_map = owner_map
