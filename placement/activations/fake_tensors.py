"""What running a call on fake tensors needs around it: stand-ins for what fake tensors cannot run, attention
counted as the fused kernels allocate, and the call's outputs made plain meta tensors for use outside.

Shape-only stand-ins: 1. constants made on `meta` (`MetaConstants` makes them on the CPU, where fake mode keeps
small constants' values); 2. MoE routing read from values (every token to experts 0..k-1: the largest per-expert
batch any routing gives, an upper bound); 3. HiDream's unpatchify by sizes held in a tensor (its reshape-only
`is_training` branch); 4. bitsandbytes layers built on meta, which cannot forward without a quant state (the
weight dequantized into a temporary, then one `F.linear`); 5. `torch.autocast(x.device.type, ...)` opened by a
model's own code (Mochi's RoPE) on meta, a device torch has no autocast for: the region runs with nothing cast
(an autocast to float32 is disabled on CUDA anyway; a lower precision one is counted at full width, an upper bound).

`FusedAttentionAccounting`: on a GPU, scaled-dot-product attention runs a fused kernel that never holds the
L x S score matrix; meta's math path builds it, ~10x too high at image sequence lengths. The Python call is
answered before dispatch with the fused kernel's allocations (output, and flash's log-sum-exp rows).

`to_meta`: fake tensors belong to their mode; outside it every tensor becomes a plain meta tensor of the same
layout, storages shared as they were, structures (pytrees and plain objects holding tensors) keeping their types.
"""

from __future__ import annotations

import copy
import inspect
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

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


class _AutocastOnMeta(torch.amp.autocast_mode.autocast):
    """`torch.autocast`, with a region opened for the meta device run uncast (5.)."""

    def __init__(self, device_type: str, dtype=None, enabled: bool = True, cache_enabled=None) -> None:
        if device_type == "meta":
            device_type, enabled = "cpu", False  # a disabled region: whatever autocast is on stays as it is
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


@contextmanager
def _autocast_on_meta() -> Iterator[None]:
    plain = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _AutocastOnMeta
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = plain


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
        with _autocast_on_meta():
            yield
    finally:
        for sub, name in patched:
            delattr(sub, name)


def fused_attention_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Allocate what a flash/memory-efficient attention kernel allocates (its log-sum-exp only while it runs) and
    return its (empty) output; mask, dropout, causal flag and scale change values, not memory."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "scaled_dot_product_attention needs query, key and value with the same number (>= 2) of dims; "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        )
    if enable_gqa:
        # Grouped-query attention: key/value carry fewer heads; the output has the query's heads.
        batch_shape = tuple(query.shape[:-2])
    else:
        batch_shape = tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    rows = batch_shape + (query.shape[-2],)
    log_sum_exp = query.new_empty(rows, dtype=torch.float32)
    output = query.new_empty(rows + (value.shape[-1],))
    del log_sum_exp
    return output


class FusedAttentionAccounting(TorchFunctionMode):
    """Within this mode, `F.scaled_dot_product_attention` allocates like the fused kernels (see module doc), and
    `on_call(query, key, value, output)`, when given, is told of each call (the FLOP tally counts it: no aten
    attention op reaches dispatch)."""

    def __init__(self, on_call: Callable[..., None] | None = None) -> None:
        super().__init__()
        self._on_call = on_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            output = fused_attention_output(*args, **kwargs)
            if self._on_call is not None:
                query, key, value = [args[i] if i < len(args) else kwargs[name]
                                     for i, name in enumerate(("query", "key", "value"))]
                self._on_call(query, key, value, output)
            return output
        return func(*args, **kwargs)


_DEPTH = 4  # how deep objects inside objects are looked into


def to_meta(tree: Any) -> Any:
    """`tree` with each tensor replaced by a meta tensor laid out alike (module doc); the rest as it is."""
    bases: dict[int, torch.Tensor] = {}  # id(original storage) -> its meta stand-in, as bytes

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes % tensor.element_size():  # bytes a view of another dtype cannot cover: lay it out alone
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        if id(storage) not in bases:
            bases[id(storage)] = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        base = bases[id(storage)].view(tensor.dtype)
        return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    return map_tensors(convert, tree)


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], tree: Any, depth: int = 0) -> Any:
    """`tree` with `function` applied to each tensor, in pytree containers and in plain objects' attributes."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return function(value)
        attributes = getattr(value, "__dict__", None)
        if depth >= _DEPTH or not isinstance(attributes, dict) or isinstance(value, (nn.Module, type)) \
                or callable(value):
            return value
        converted = {name: map_tensors(function, item, depth + 1) for name, item in attributes.items()}
        if all(converted[name] is item for name, item in attributes.items()):
            return value  # nothing inside to convert: the object itself
        duplicate = copy.copy(value)
        vars(duplicate).update(converted)  # through __dict__: frozen dataclasses too
        return duplicate

    return tree_map(leaf, tree)
