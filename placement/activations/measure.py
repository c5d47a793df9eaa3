"""measure_activations: the same quantity `estimate_activations` predicts, measured on a real run.

It runs the call for real (real tensors, real kernels) under
`torch.distributed._tools.mem_tracker.MemTracker` — torch's own tracker, a different implementation from
the estimator's — and reads its peak snapshot without the parameter and buffer bytes. Tests and
`benchmarks/activation_accuracy.py` use it as the reference the estimate must match; it needs the memory
the call really takes, so use it on small configs.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_leaves

# MemTracker's snapshot categories that are weights, not activations.
_WEIGHT_CATEGORIES = ("Parameter", "Buffer")


def measure_activations(
    module: nn.Module,
    args: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "forward",
) -> int:
    """Peak bytes, on top of the weights, of really running `module.<method>(*args, **kwargs)` under
    `torch.inference_mode()`: inputs, intermediates and output, as `estimate_activations` counts them."""
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    tracker = MemTracker()
    tracker.track_external(module, *inputs)
    with torch.inference_mode(), tracker:
        getattr(module, method)(*args, **kwargs)
    return activation_peak(tracker)


def activation_peak(tracker: MemTracker) -> int:
    """The peak bytes a finished MemTracker saw on its one device, parameters and buffers left out."""
    peaks = tracker.get_tracker_snapshot("peak")
    if not peaks:
        return 0
    if len(peaks) > 1:
        raise RuntimeError(
            f"measure_activations measures one device at a time; the call touched {sorted(map(str, peaks))}."
        )
    (snapshot,) = peaks.values()
    return sum(value for key, value in snapshot.items() if key != "Total" and key not in _WEIGHT_CATEGORIES)
