"""What one call of a pipeline runs of each component, for planning its activations and runs per call: a diffusers
pipeline's is captured by running its own `__call__` on stand-ins; our pipelines describe theirs."""

from __future__ import annotations

from .capture import CapturedCall, ExampleCall, capture_call

__all__ = ["CapturedCall", "ExampleCall", "capture_call"]
