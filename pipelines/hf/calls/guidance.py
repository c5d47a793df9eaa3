"""How a pipeline's call runs classifier-free guidance, learned while call capture runs its own `__call__`: the
scheduler's `step` marks the denoising steps and carries the latents (their batch is the call's), and each
component's forwards between two steps say whether it ran once on a batch of two (the branches concatenated), twice
on the latents' batch (true CFG: two calls), or once on the latents' batch (guidance distilled or off). No class is
named: a diffusers release that changes a `__call__` changes what is learned with it."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from placement.guidance import GuidanceCall, GuidanceMode


@dataclass(frozen=True, kw_only=True)
class Forward:
    """One forward of a component as the pipeline made it: the denoising step it ran in (steps done before it),
    the batch of its first floating input, and its floating inputs' and outputs' bytes."""

    component: str
    step: int
    batch: int | None
    input_bytes: int
    output_bytes: int


@dataclass(kw_only=True)
class GuidanceWatch:
    """What call capture records for `learned()`: each forward, and the latents' batch at each scheduler step."""

    forwards: list[Forward] = field(default_factory=list)
    latent_batches: list[int | None] = field(default_factory=list)

    def forward(self, component: str, args: tuple, kwargs: dict, output: Any) -> None:
        inputs = _floating((args, kwargs))
        self.forwards.append(Forward(component=component, step=len(self.latent_batches),
                                     batch=_batch(inputs[0]) if inputs else None,
                                     input_bytes=sum(_bytes(t) for t in inputs),
                                     output_bytes=sum(_bytes(t) for t in _floating(output))))

    @contextlib.contextmanager
    def stepping(self, pipe: Any) -> Iterator[None]:
        """The pipeline's scheduler counts its steps and the latents it steps while the call is captured. Its class
        is swapped for a counting subclass (not its `step` attribute): a pipeline that copies its scheduler (LTX-2's
        audio one) gets a copy that steps itself, uncounted."""
        scheduler = getattr(pipe, "scheduler", None)
        original = type(scheduler)
        if not callable(getattr(original, "step", None)):
            yield
            return
        watch = self

        def step(this, *args, **kwargs):
            if this is scheduler:
                sample = kwargs.get("sample", args[2] if len(args) > 2 else None)
                watch.latent_batches.append(_batch(sample) if isinstance(sample, torch.Tensor) else None)
            return original.step(this, *args, **kwargs)

        scheduler.__class__ = type(original.__name__, (original,), {"step": step, "__module__": original.__module__})
        try:
            yield
        finally:
            scheduler.__class__ = original

    def learned(self) -> dict[str, GuidanceCall]:
        """Per denoiser (a component whose forward is the last before a scheduler step), how it runs guidance
        (`GuidanceMode`), from the steps it made."""
        last = {}  # step -> the component whose forward came last before it
        for forward in self.forwards:
            if forward.step < len(self.latent_batches):
                last[forward.step] = forward.component
        found = {}
        for name in dict.fromkeys(last.values()):
            steps = {step for step, component in last.items() if component == name}
            found[name] = _mode(name, [f for f in self.forwards if f.component == name and f.step in steps],
                                self.latent_batches)
        return found


def _mode(name: str, forwards: list[Forward], latent_batches: list[int | None]) -> GuidanceCall:
    per_step = Counter(forward.step for forward in forwards)
    calls = set(per_step.values())
    ratios = {None if forward.batch is None or not latent_batches[forward.step] else
              forward.batch / latent_batches[forward.step] for forward in forwards}
    sizes = dict(input_bytes=max(f.input_bytes for f in forwards), output_bytes=max(f.output_bytes for f in forwards))
    steps = len(per_step)
    if calls == {1} and ratios == {2}:
        return GuidanceCall(mode=GuidanceMode.BATCH_OF_TWO, seen=f"{name} runs once per step on a batch of two "
                            f"(twice the latents' batch, in each of {steps} steps)", **sizes)
    if calls == {2} and ratios == {1}:
        return GuidanceCall(mode=GuidanceMode.TWO_CALLS, seen=f"{name} runs twice per step on the latents' batch "
                            f"(true CFG, in each of {steps} steps)", **sizes)
    if calls == {1} and ratios == {1}:
        return GuidanceCall(mode=GuidanceMode.NONE, seen=f"{name} runs once per step on the latents' batch", **sizes)
    return GuidanceCall(mode=GuidanceMode.NONE, seen=(
        f"{name} runs {sorted(calls)} time(s) per step on {sorted(r for r in ratios if r is not None)} times the "
        "latents' batch, not one batch of two nor two calls"), **sizes)


def _floating(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def _batch(tensor: torch.Tensor) -> int | None:
    return int(tensor.shape[0]) if tensor.dim() >= 1 else None


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["Forward", "GuidanceWatch"]
