"""FLOPs and bytes touched by one call, counted on the same fake tensors as the activation estimate.

The plan's time model (`placement.time_model`) needs what a component computes per run at the call's shapes:
`FlopTally` counts it while the estimate runs, for free next to the fake forward that already happens. The
formulas are torch's own (`torch.utils.flop_counter.flop_registry`: matmuls, convolutions, attention kernels),
applied as `FlopCounterMode` applies them: an op without a formula is decomposed when it has a decomposition
(under inference mode `aten.linear` reaches dispatch whole; its decomposition holds the `addmm`), and counts 0
otherwise (elementwise ops, norms: memory-bound, seen in the bytes instead). So a call counted here equals
`FlopCounterMode` on a real run of the same call, to the FLOP (tests hold it), except attention:
`FusedAttentionAccounting` answers `scaled_dot_product_attention` before dispatch (as the fused GPU kernels
allocate), so it reports the call here (`attention`), counted as the fused kernels compute it: Q K^T and P V,
2 FLOPs per multiply-add (on the CPU, FlopCounterMode sees `_scaled_dot_product_flash_attention_for_cpu`, which
has no formula, and counts 0).

Why not `FlopCounterMode` itself: it tracks the module hierarchy with global module hooks (costly on a FLUX-size
DiT, and the block memo must see no foreign hooks) and keeps per-module tables the plan does not read.

Bytes touched: per op that computes (not views), the bytes of its tensor inputs and outputs: a memory-traffic
upper bound without caches, weights read once per op that uses them; the time model sets it against the memory
bandwidth for the memory-bound part of a run (VAE decoders, norms).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

_SHAPE_QUERIES = {torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default, torch.ops.aten.size.default,
                  torch.ops.aten.stride.default, torch.ops.aten.numel.default, torch.ops.aten.dim.default,
                  torch.ops.aten.is_contiguous.default, torch.ops.aten.sym_numel.default,
                  torch.ops.aten.sym_storage_offset.default, torch.ops.aten.storage_offset.default,
                  torch.ops.prim.layout.default, torch.ops.prim.device.default}


class FlopTally(TorchDispatchMode):
    """A dispatch mode adding up `flops` and `bytes_touched` of the ops it sees (module doc).

    Enter it inside the `FakeTensorMode` and outside (before) the `LiveStorageTracker`: the tracker then sees each
    op whole, as without the tally, and the decompositions the tally makes reach only the fake mode below it."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes_touched = 0
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within it, ops count nothing (a replayed block's stand-in allocations: its work is `add`ed instead)."""
        saved, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = saved

    def add(self, flops: int, bytes_touched: int = 0) -> None:
        """Count work done outside dispatch (a replayed block, a fused attention call)."""
        self.flops += flops
        self.bytes_touched += bytes_touched

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        """A fused attention call: 2 x (Q K^T) + 2 x (P V) multiply-adds; it reads Q, K, V and writes the output."""
        rows = math.prod(output.shape[:-1])  # batch x heads x query length
        keys = key.shape[-2]
        self.add(2 * rows * keys * query.shape[-1] + 2 * rows * keys * value.shape[-1],
                 sum(_nbytes(t) for t in (query, key, value, output)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_QUERIES or self._paused:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet not in flop_registry:
            with self:  # as FlopCounterMode does: the parts come back through this mode
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        if not func.is_view:  # a reshape moves no data
            self.bytes_touched += _traffic(args, kwargs, out)
        return out


def _traffic(args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor inputs, and its outputs but those it wrote in place."""
    inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    storages = {id(t.untyped_storage()) for t in inputs}
    written = [leaf for leaf in tree_leaves(out)
               if isinstance(leaf, torch.Tensor) and id(leaf.untyped_storage()) not in storages]
    return sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in written)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["FlopTally"]
