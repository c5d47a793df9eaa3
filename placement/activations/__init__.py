"""Activation memory: the peak a component's forward allocates for a given call, estimated on fake tensors.

estimate.py      `estimate_call` (peak and meta outputs) and `estimate_activations` (the peak), their errors
tracker.py       the dispatch-level tracker of live storages and their peak
attention.py     fused-attention accounting (no N x N matrix is counted, as the fused kernels allocate none)
stand_ins.py     shape-only stand-ins for what fake tensors cannot run (constants made on meta, MoE routing)
isolation.py     what an estimate sets aside while it runs: accelerate's hooks, torch's log lines and warnings
block_memo.py    identical blocks (and a VAE's per-frame decoder calls) called with inputs seen before are replayed,
                 not run (same peak to the byte)
call_effects.py  what a replay redoes: a call's outputs and its writes into the lists and dicts it was given
cache.py         a call estimated before on an unchanged module is answered from memory (across plans)
signatures.py    the keys of both: a call's input signature, a module's state
observers.py     `CallObserver`: hooks that only note which module ran, told of replayed and cached calls too
meta_outputs.py  a call's return value with its fake tensors made plain meta tensors
measure.py       the reference: torch's MemTracker on real tensors, for tests and benchmarks

Switches for A/B runs (read at each estimate): `PLACEMENT_BLOCK_MEMO=0`, `PLACEMENT_ESTIMATE_CACHE=0`.
"""

from .estimate import ActivationEstimateError, CallEstimate, estimate_activations, estimate_call
from .observers import CallObserver

__all__ = ["ActivationEstimateError", "CallEstimate", "CallObserver", "estimate_activations", "estimate_call"]
