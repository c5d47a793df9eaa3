"""Activation memory: the peak a component's forward allocates for a given call, estimated on fake tensors.

estimate.py   `estimate_activations` (FakeTensorMode + a live-storage tracker), its errors
tracker.py    the dispatch-level tracker of live storages and their peak
attention.py  fused-attention accounting (no N x N matrix is counted, as the fused kernels allocate none)
stand_ins.py  shape-only stand-ins for what fake tensors cannot run (constants made on meta, MoE routing)
isolation.py  what an estimate sets aside while it runs: accelerate's hooks, torch's log lines and warnings
measure.py    the reference: torch's MemTracker on real tensors, for tests and benchmarks
"""

from .estimate import ActivationEstimateError, InvalidActivationCallError, estimate_activations

__all__ = ["ActivationEstimateError", "InvalidActivationCallError", "estimate_activations"]
