"""Activation memory: the peak a component's forward allocates for a given call, estimated on fake tensors.

estimate.py      `estimate_call` (peak and meta outputs) and `estimate_activations` (the peak), their errors;
                 `measure_activations`, the reference: torch's MemTracker on real tensors, for tests and benchmarks
tracking.py      what a run is watched by: the dispatch-level tracker of live storages and their peak, the FLOP
                 tally, and `CallObserver` (hooks that only note which module ran, told of skipped calls too)
fake_tensors.py  what fake tensors need around them: shape-only stand-ins for what they cannot run (constants made
                 on meta, MoE routing), fused-attention accounting (no N x N matrix is counted, as the fused kernels
                 allocate none), and outputs made plain meta tensors
isolation.py     what an estimate sets aside while it runs: accelerate's hooks, torch's log lines and warnings
memo.py          calls not run twice: identical blocks (and a VAE's per-frame decoder calls) called with inputs seen
                 before are replayed (same peak to the byte); a call estimated before on an unchanged module is
                 answered from memory (across plans)
calls.py         a call described: the keys of both (its input signature, its module's state), and what a replay
                 redoes (its outputs and its writes into the lists and dicts it was given)

Switches for A/B runs (read at each estimate): `PLACEMENT_BLOCK_MEMO=0`, `PLACEMENT_ESTIMATE_CACHE=0`.
"""

from .estimate import ActivationEstimateError, CallEstimate, estimate_activations, estimate_call
from .tracking import CallObserver

__all__ = ["ActivationEstimateError", "CallEstimate", "CallObserver", "estimate_activations", "estimate_call"]
