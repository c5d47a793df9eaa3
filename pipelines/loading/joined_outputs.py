"""Components whose outputs a diffusers pipeline joins right where they come back.

diffusers' pipelines send each component its inputs on that component's own device
(`get_module_execution_device`) and move the results on afterwards, so each output comes back on its
component's device. SDXL's `encode_prompt`, and the pipelines that copy it (img2img, inpaint, ControlNet, PAG,
T2I-Adapter, AnimateDiff SDXL: every class with `StableDiffusionXLLoraLoaderMixin`), concatenates the hidden
states of `text_encoder` and `text_encoder_2` before moving them: with the two encoders on two GPUs that is
"Expected all tensors to be on the same device". `text_encoder` therefore hands its outputs over on
`text_encoder_2`'s execution device, where the join happens; nothing else moves.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hooks.hook_utils import add_hook_last
from hooks.input_moving import DeliverOutputsHook
from placement.devices import torch_device
from placement.plan_schema import Plan

# (component whose outputs travel, component whose device they are joined on)
TEXT_ENCODERS_JOINED = ("text_encoder", "text_encoder_2")


def deliver_joined_outputs(pipe: Any, plan: Plan) -> None:
    """Install the output hand-over for the joins of `pipe`'s class, where the two components run apart."""
    if not _joins_text_encoders(type(pipe)):
        return
    source, target = TEXT_ENCODERS_JOINED
    components = getattr(pipe, "components", {})
    if not all(isinstance(components.get(name), nn.Module) and name in plan.components for name in (source, target)):
        return
    source_device = plan.components[source].execution_device
    target_device = plan.components[target].execution_device
    if source_device != target_device:
        add_hook_last(components[source], DeliverOutputsHook(torch_device(target_device)))


def _joins_text_encoders(cls: type) -> bool:
    return any(base.__name__ == "StableDiffusionXLLoraLoaderMixin" for base in cls.__mro__)
