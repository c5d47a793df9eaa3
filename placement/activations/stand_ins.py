"""Shape-only stand-ins for the few things real models do that fake tensors cannot run.

1. `torch.tensor(data, device="meta")`: under `FakeTensorMode` a constant made straight on `meta` is a real
   meta tensor that the next in-place op refuses, and it has no values. `MetaConstants` makes such constants
   on the CPU instead, where the fake mode keeps small constants' values: code that reads them back (HiDream's
   `img_sizes`, used as slice bounds) runs. An empty one (transformers' KV caches start as
   `torch.tensor([], device=...)` and grow by `cat` with meta tensors) is moved to meta, where the fake mode
   makes it a fake meta tensor. So LLM-style encoders (Llama, Gemma2, Qwen2.5-VL) are estimated as the
   pipelines call them, their KV cache (allocated when `use_cache` is left on, as diffusers leaves it) included.
2. Mixture-of-experts routing (`moe_infer`, DeepSeek-V3 style, used by HiDream-I1): how many tokens each
   expert gets is read from the routing's values (`bincount().cpu().numpy()`), which fake tensors do not have.
   `worst_case_routing` replaces it, for the length of the estimate, by the same computation under a routing
   chosen without data: every token goes to experts 0..k-1 (k = activated experts per token). That is a
   routing the gate may really produce and the largest per-expert batch any routing gives (each expert sees at
   most every token once), so the estimate is an upper bound of the real peak, tight when routing is skewed,
   above it by the experts' intermediate (tokens x hidden) for a balanced routing.
3. Unpatchifying by sizes held in a tensor (HiDream-I1: `unpatchify(x, img_sizes, is_training)` slices each
   image by `img_sizes[i]`'s values). Its other branch (`is_training=True`) computes the same output bytes by
   reshapes alone; `shape_only_unpatchify` takes it for the length of the estimate.
4. bitsandbytes layers built on meta (`Linear4bit`, `Linear8bitLt`): their quantization state is made when the
   weights are quantized on a device, so their `forward` fails without it (an assert in `fix_4bit_weight_quant_state
   _from_module`). For the estimate they compute as bitsandbytes computes a batch of tokens: the weight
   dequantized into a temporary of the compute dtype, then one `F.linear` (`_dequantized_linear`).
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_BITSANDBYTES_LINEARS = ("Linear4bit", "LinearFP4", "LinearNF4", "Linear8bitLt")


class MetaConstants(TorchFunctionMode):
    """`torch.tensor(data, device="meta")` built on the CPU and moved (see module doc, 1.)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func is torch.tensor and device is not None and torch.device(device).type == "meta":
            constant = torch.tensor(*args, **{**kwargs, "device": "cpu"})
            return constant.to("meta") if constant.numel() == 0 else constant
        return func(*args, **kwargs)


def _worst_case_moe_infer(self, x: torch.Tensor, flat_expert_indices: torch.Tensor,
                          flat_expert_weights: torch.Tensor) -> torch.Tensor:
    """`moe_infer` with every token routed to experts 0..k-1 (see module doc, 2.); the same ops otherwise."""
    activated = self.num_activated_experts
    expert_cache = torch.zeros_like(x)
    order = flat_expert_indices.argsort()
    token_indices = order // activated
    tokens = x.shape[0]
    for index in range(min(activated, len(self.experts))):
        chosen = token_indices[index * tokens:(index + 1) * tokens]
        expert_out = self.experts[index](x[chosen])
        expert_out.mul_(flat_expert_weights[order[index * tokens:(index + 1) * tokens]])
        expert_cache = expert_cache.to(expert_out.dtype)
        expert_cache.scatter_reduce_(0, chosen.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
    return expert_cache


def _routes_by_values(module: nn.Module) -> bool:
    return callable(getattr(module, "moe_infer", None)) and isinstance(getattr(module, "experts", None),
                                                                        nn.ModuleList) \
        and isinstance(getattr(module, "num_activated_experts", None), int)


def _unpatchifies_by_values(module: nn.Module) -> bool:
    unpatchify = getattr(type(module), "unpatchify", None)
    return callable(unpatchify) and list(inspect.signature(unpatchify).parameters) == [
        "self", "x", "img_sizes", "is_training"]


def _forces_inference_output(module: nn.Module) -> bool:
    # With this flag set, the model's own is_training branch is skipped too: nothing to stand in for.
    config = getattr(module, "config", None)
    return bool(config.get("force_inference_output", False)) if isinstance(config, dict) else False


def _shape_only_unpatchify(self, x: torch.Tensor, img_sizes, is_training: bool) -> torch.Tensor:
    return type(self).unpatchify(self, x, img_sizes, True)


def _quantized_without_state(module: nn.Module) -> bool:
    """A bitsandbytes linear whose weight has no quantization state yet (built on meta; see module doc, 4.)."""
    if type(module).__name__ not in _BITSANDBYTES_LINEARS or not type(module).__module__.startswith("bitsandbytes"):
        return False
    weight = getattr(module, "weight", None)
    return getattr(weight, "quant_state", None) is None and getattr(weight, "CB", None) is None


def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
    """What a bitsandbytes linear allocates for a batch of tokens: its weight dequantized to the compute dtype
    (a temporary), then the matmul; the output in the input's dtype, as bitsandbytes returns it."""
    dtype = getattr(self, "compute_dtype", None) or x.dtype
    weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=x.device)
    bias = None if self.bias is None else torch.empty(self.out_features, dtype=dtype, device=x.device)
    return F.linear(x.to(dtype), weight, bias).to(x.dtype)


def sized_by_values(module: nn.Module) -> bool:
    """Whether `module`'s output is sized by values it computes (3.): run with values kept (`estimate_call(...,
    keep_values=True)`) its own code gives the real output shape, which the stand-in does not."""
    return any(_unpatchifies_by_values(sub) and not _forces_inference_output(sub) for sub in module.modules())


@contextmanager
def shape_only_stand_ins(module: nn.Module, *, values_kept: bool = False) -> Iterator[None]:
    """Within it, `module`'s MoE routing (2.) and value-sized unpatchify (3.) run without data, and its
    bitsandbytes layers without quantization state (4.) as the dequantized matmul; with `values_kept`,
    constants carry their values and the unpatchify runs as it is."""
    patched = []
    for sub in module.modules():
        if _quantized_without_state(sub):
            sub.forward = types.MethodType(_dequantized_linear, sub)
            patched.append((sub, "forward"))
        if _routes_by_values(sub):
            sub.moe_infer = types.MethodType(_worst_case_moe_infer, sub)
            patched.append((sub, "moe_infer"))
        if _unpatchifies_by_values(sub) and not _forces_inference_output(sub) and not values_kept:
            sub.unpatchify = types.MethodType(_shape_only_unpatchify, sub)
            patched.append((sub, "unpatchify"))
    try:
        yield
    finally:
        for sub, name in patched:
            delattr(sub, name)
