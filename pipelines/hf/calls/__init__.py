"""What one call of a pipeline runs of each component, for planning its activations and runs per call.

For a diffusers pipeline it is learned by running the pipeline's own `__call__` on stand-in components
(`capture_call`): every class is call-aware without code naming it. Our own pipelines describe their calls
(`activation_inputs`, `runs_per_call`; `pipelines.loading.planning.describe_call` chooses).

capture.py         the capture: recorders in place of the modules, outputs from fake-tensor runs, runs counted;
                   `call=` checked against the pipeline's `__call__` signature, blank images for inputs left out,
                   what capture cannot see by itself (each row with its reason), ExampleCall and the call errors
vae_techniques.py  VAE tiling/slicing: which VAEs offer them, and a VAE call estimated with them on
"""

from __future__ import annotations

from .capture import CapturedCall, ExampleCall, capture_call

__all__ = ["CapturedCall", "ExampleCall", "capture_call"]
