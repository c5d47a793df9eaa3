"""Guidance branches in parallel (docs/design.md, "Two GPUs, one call"): how a call runs its guidance, as call capture
learned it (`GuidanceCall`), and what the plan chose for each denoiser that runs it (`GuidanceParallel`, a field of
the Plan). Classifier-free guidance runs the denoiser twice per step: on a batch of two (the unconditional and the
conditional inputs concatenated: SD 1.x/SDXL/SD3, PixArt, AuraFlow) or as two calls (true CFG: Qwen-Image, Wan,
FLUX's `true_cfg_scale`). Either way the two branches are independent until the pipeline combines them, so two GPUs
that each hold the denoiser can run them at once. A guidance-distilled model (FLUX.1-dev) runs once per step on a
batch of one: nothing to run in parallel.

The choice (`guidance_choice.choose_guidance_parallel`) and its seconds (`time_model.guidance_parallel_seconds`) live
beside this file; the runtime is `hooks.guidance_parallel`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from pydantic import BaseModel, ConfigDict

from .time_model import seconds_text


class GuidanceMode(str, Enum):
    BATCH_OF_TWO = "batch of two"  # one forward per step on the two branches concatenated along the batch
    TWO_CALLS = "two calls per step"  # one forward per branch
    NONE = "none"  # one forward per step on the latents' batch (guidance distilled or off): nothing to split


@dataclass(frozen=True, kw_only=True)
class GuidanceCall:
    """How one component runs guidance in a call, learned from the pipeline's own `__call__` (call capture): its
    mode, what was seen (for the plan's reasons), and per run the bytes its floating inputs and outputs take (what
    a replica on another GPU is sent and sends back)."""

    mode: GuidanceMode
    seen: str
    input_bytes: int = 0
    output_bytes: int = 0

    @property
    def branches_per_run(self) -> int:
        """Branches one run computes: two in a batch of two, one otherwise."""
        return 2 if self.mode is GuidanceMode.BATCH_OF_TWO else 1


class GuidanceParallel(BaseModel):
    """The plan's word on running one denoiser's guidance branches on two GPUs: whether it does (`applied`), why
    (or why not), the GPUs, the memory the second copy and the gather take, and the predicted seconds of the
    component's runs per call both ways (None: its FLOPs are not known)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    component: str
    mode: GuidanceMode
    applied: bool
    reason: str
    devices: list[int] = []  # [where it executes, where its replica runs]
    replica_bytes: int = 0  # the second copy's weights, resident on the replica's GPU
    replica_activation_bytes: int = 0  # the replica's activations while a branch runs there
    gather_bytes: int = 0  # per run, the replica's outputs arriving on the execution device
    peer_bytes_per_call: int = 0  # inputs sent to the replica and outputs brought back, per call
    seconds_parallel: Optional[float] = None
    seconds_one_gpu: Optional[float] = None
    options: list[str] = []  # what each other option would cost, one line each

    def summary(self) -> str:
        """"transformer: guidance in parallel on GPUs 0 and 1: 7.9 s per call; one GPU: 14.1 s" (or why not)."""
        if not self.applied:
            return f"{self.component}: guidance branches not in parallel: {self.reason}"
        text = f"{self.component}: guidance in parallel on GPUs {self.devices[0]} and {self.devices[1]} ({self.reason})"
        if self.seconds_parallel is not None and self.seconds_one_gpu is not None:
            text += (f": {seconds_text(self.seconds_parallel)} of denoising per call; one GPU: "
                     f"{seconds_text(self.seconds_one_gpu)}")
        return text


__all__ = ["GuidanceCall", "GuidanceMode", "GuidanceParallel"]
