"""What one component runs for a `call=` (`ExampleCall`), and the errors of a `call=` that cannot be planned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from placement import estimate_call

# Keys of `call=` that say how many times the denoiser runs, not what it runs on (our pipelines' `runs_per_call`).
RUN_KEYS = ("num_inference_steps", "strength")
# Keys of `call=` that choose memory techniques rather than sizes (`pipelines.loading.memory_techniques`).
TECHNIQUE_KEYS = ("vae_tiling", "vae_slicing")


@dataclass(frozen=True, kw_only=True)
class ExampleCall:
    """One component's part of a pipeline call: `getattr(module, method)(*args, **kwargs)`, floating tensors on
    meta (integer ones may be real: ids and masks, whose values `keep_values` lets the estimate read)."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    method: str = "forward"
    keep_values: bool = False  # its integer inputs' values size tensors (`placement.estimate_call`)

    def estimate(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> int:
        """Peak activation bytes of this call on `module` (see `placement.estimate_call`)."""
        return estimate_call(module, self.args, dict(self.kwargs), method=self.method, dtype=dtype,
                             keep_values=self.keep_values).peak_bytes
