"""Activation memory: the peak a component's forward allocates for a given call, estimated on fake tensors.

`PLACEMENT_BLOCK_MEMO=0` and `PLACEMENT_ESTIMATE_CACHE=0` switch off the two ways an estimate skips calls (A/B runs).
"""

from .estimate import ActivationEstimateError, CallEstimate, estimate_activations, estimate_call
from .tracking import CallObserver

__all__ = ["ActivationEstimateError", "CallEstimate", "CallObserver", "estimate_activations", "estimate_call"]
