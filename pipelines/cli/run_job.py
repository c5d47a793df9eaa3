"""The steps of `placement run` once its arguments are read: check DIR (nothing left: say so, load nothing), plan
and print the verdict, load that very plan, make the images. Under torchrun each rank loads its replica and
DIR is checked through rank 0, so every rank agrees on what is left."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from ..distributed.images import RunFolder
from ..distributed.job import ImagesInterrupted, RunResult, make_images
from ..distributed.replica import Launch
from ..errors import ImageRunError
from ..hf.quiet import quiet
from .args import guidance_parallel_arg, torch_dtype
from . import EXIT_INTERRUPTED
from .targets import STEPS, TargetPlanner, hf_libraries, in_flag_names, warnings_once


@dataclass(kw_only=True)
class RunJob:
    args: argparse.Namespace
    launch: Launch
    prompts: list[str]
    source: str  # what from_pretrained loads: the folder, or the Hub id
    label: str  # how run.json names it
    configs: Path  # a local folder with its configs
    cls: type
    given: dict[str, Any]  # what the user gave: the pipeline's own defaults apply to the rest
    call: dict[str, Any]  # given + defaults found: for the plan and run.json
    max_memory: Optional[dict]

    def run(self) -> Optional[RunResult]:
        """The result on rank 0 (None on the others); ImagesInterrupted after a requested stop."""
        first = self.launch.rank == 0
        folder = RunFolder(self.args.out, source=self.label, call=self.call, seed=self.args.seed,
                           overwrite=self.args.overwrite) if first else None
        if folder is not None and not self.launch.distributed:  # under torchrun: checked through rank 0, loaded
            if not folder.todo(self.prompts):
                print(f"All {len(self.prompts)} image(s) are already in {self.args.out} (pass --overwrite to make "
                      "them again).")
                return RunResult(made=0, skipped=len(self.prompts), failed=())
            folder.note_unrecorded(self.prompts)
        with warnings_once():
            strategy = self._plan(self.max_memory) if not self.launch.distributed else self.args.strategy
            replica = self._load(strategy, self.max_memory)
        with replica:
            if first and replica.group is not None:
                print(f"{self.launch.world_size} replica(s); rank 0 on {replica.group.label}: "
                      f"{replica.group.plan.verdict.headline}", flush=True)
            try:
                result = make_images(replica, self.prompts, folder=folder, call=self.given, seed=self.args.seed,
                                     steps=self.call.get(STEPS), progress=True)
            except ImagesInterrupted:
                replica.close(wait_for_the_others=True)  # every rank stopped at the same round
                if first:
                    raise
                sys.exit(EXIT_INTERRUPTED)  # rank 0 says it, once
            if first and result.made:
                _print_run_check(replica.pipe)
        if result.failed:
            raise ImageRunError(f"{len(result.failed)} image(s) failed: " + "; ".join(result.failed))
        return result if first else None

    def _plan(self, max_memory):
        """The plan a plain run loads, made for its call; its verdict and advice printed first."""
        from .advice import plan_with_advice

        plan_call = self._activation_call()
        if plan_call and STEPS in self.call:
            plan_call[STEPS] = self.call[STEPS]
        planner = TargetPlanner(target=str(self.configs), device_map=self.args.strategy, max_memory=max_memory,
                                offload_folder=None, call=plan_call or None,
                                guidance_parallel=guidance_parallel_arg(self.args))
        example = self.args.max_memory.text if self.args.max_memory is not None else "0=24GiB"
        plan, advice = plan_with_advice(planner, dtype=self.args.dtype, max_memory=max_memory,
                                        budgets_example=example)
        print(in_flag_names(plan.verdict.headline))
        for line in [*plan.verdict.warnings, *planner.notes, *advice]:
            print(f"  ! {in_flag_names(line)}")
        print(flush=True)
        return plan

    def _activation_call(self, *, announce: bool = True) -> Optional[dict[str, Any]]:
        """The call's sizes to plan its activations for, or None (said why) when they cannot be known."""
        from .targets import describes_its_call

        sizes = {key: self.call[key] for key in ("height", "width", "guidance_scale") if key in self.call}
        why = None
        if not describes_its_call(self.configs, self.cls):
            why = f"{self.cls.__name__} does not describe the inputs of its call"
        elif "height" not in sizes or "width" not in sizes:
            why = "the pipeline chooses its image size itself (give --height and --width)"
        if why is not None and announce and self.launch.rank == 0:
            print(f"Planning for weights only: {why}.")
        return None if why is not None else sizes

    def _load(self, strategy, max_memory):
        from ..distributed import load_replica

        # Replica planning weighs activations; num_inference_steps is left to the plain run's planner (above).
        replica_call = self._activation_call(announce=False) if self.launch.distributed else None
        with quiet(preload=hf_libraries(self.configs)):
            return load_replica(self.source, self.prompts, pipeline_class=self.cls,
                                torch_dtype=torch_dtype(self.args.dtype), max_memory=max_memory,
                                call=replica_call, group_size=self.args.group_size, strategy=strategy,
                                timeout=timedelta(seconds=self.args.timeout),
                                guidance_parallel=guidance_parallel_arg(self.args))


def _print_run_check(pipe: Any) -> None:
    """The log's measured vs predicted seconds per component (`pipe.placement_report()`); the first image's call
    pays for warm-up, so a profile is corrected from the second on."""
    from ..loading.run_check import is_checked

    if is_checked(pipe):  # a pipeline loaded on one device (a replica on the CPU) has no plan's seconds to check
        print(in_flag_names(pipe.placement_report()), flush=True)
