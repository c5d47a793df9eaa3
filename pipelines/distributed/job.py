"""The `placement run` job: the images still to make, shared out over the replicas, each written at once.

Prompt i uses a CPU generator seeded `seed + i`, so its image never depends on which replica made it. Replicas
work in rounds (each rank makes one image, rank 0 writes them) and agree between rounds whether to stop.
Ctrl-C (or the SIGTERM torchrun's agent sends) finishes the current image first; a second one stops at once,
but one press reaches a torchrun worker twice within milliseconds, so signals that close count as one. One bar
counts every step of every image: the pipe's own `progress_bar` is swapped for one that advances it."""

from __future__ import annotations

import io
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from tqdm.auto import tqdm

from ..errors import ImageRunError
from .images import ImageRecord, RunFolder
from .replica import Replica


SAME_PRESS_SECONDS = 1.0


class StopRequest:
    """Set by the first signal; `requested` is read between images."""

    def __init__(self, *, announce: bool):
        self.requested = False
        self.first_at = 0.0
        self.announce = announce

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self.first_at = True, now
            if self.announce:
                print("\nStopping after the current image (Ctrl-C again to stop now).", file=sys.stderr, flush=True)
            return
        if now - self.first_at > SAME_PRESS_SECONDS:
            raise KeyboardInterrupt


@contextmanager
def stop_requests(*, announce: bool = True) -> Iterator[StopRequest]:
    """A StopRequest set by SIGINT and SIGTERM inside the block; off the main thread (no handlers) it is never set."""
    request = StopRequest(announce=announce)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _ForwardedSteps(tqdm):
    """A silent per-call bar whose steps advance `overall`."""

    def __init__(self, iterable=None, *, total=None, overall: tqdm):
        super().__init__(iterable, total=total, disable=True)
        self._overall = overall

    def __iter__(self):
        for item in self.iterable:
            yield item
            self._overall.update(1)

    def update(self, n: float = 1) -> bool | None:
        self._overall.update(n)
        return None


def run_bar(*, images: int, steps: int, enabled: bool) -> tqdm:
    return tqdm(total=images * steps, unit="step", desc=f"{images} image(s)", disable=None if enabled else True,
                dynamic_ncols=True)


@contextmanager
def counting_steps(pipe: Any, overall: tqdm) -> Iterator[None]:
    """Inside the block, the steps `pipe` runs advance `overall` (its own step bar is not drawn)."""
    def progress_bar(iterable=None, total=None, **_ignored):
        return _ForwardedSteps(iterable, total=total, overall=overall)

    had_own = "progress_bar" in vars(pipe)
    previous = vars(pipe).get("progress_bar")
    pipe.progress_bar = progress_bar
    try:
        yield
    finally:
        if had_own:
            pipe.progress_bar = previous
        else:
            del pipe.progress_bar


class ImagesInterrupted(KeyboardInterrupt):
    """The run stopped on request after writing the images made so far; the message says how far it got."""


@dataclass(frozen=True, kw_only=True)
class RunResult:
    made: int  # images written by this session
    skipped: int  # already done by an earlier run
    failed: tuple[str, ...]  # "prompt 3 on rank 1 (GPU 1): error"


def make_images(replica: Replica, prompts: list[str], *, folder: Optional[RunFolder], call: Mapping[str, Any],
                seed: int, steps: Optional[int], progress: bool) -> RunResult:
    """Make the images `folder` (rank 0's; None on the others) lacks; raises ImagesInterrupted on a stop."""
    launch = replica.launch
    todo = _shared_todo(replica, folder, prompts)
    mine = todo[launch.rank::launch.world_size]
    first = launch.rank == 0
    made, failed = 0, []
    bar = run_bar(images=len(todo), steps=steps or 1, enabled=progress and first)
    with stop_requests(announce=first) as stop, bar:
        for round_number in range(math.ceil(len(todo) / launch.world_size)):
            bar.set_description(f"image {round_number * launch.world_size + 1}/{len(todo)}")
            index = mine[round_number] if round_number < len(mine) else None
            record = None if index is None else _make(replica, index, prompts[index], call, seed,
                                                      bar if steps else None)
            gathered = replica.exchange.gather_to_first(record)
            for done in sorted(filter(None, gathered or []), key=lambda r: r.index):
                folder.write(done, world_size=launch.world_size)
                made += done.error is None
                if done.error is not None:
                    failed.append(f"prompt {done.index} on rank {done.rank} ({done.replica}): {done.error}")
                if done.rank != 0 or not steps:  # rank 0's own steps advanced the bar as they ran
                    bar.update(steps or 1)
            if any(replica.all_gather(stop.requested)):
                raise ImagesInterrupted(_stopped_line(folder, made, prompts))
    return RunResult(made=made, skipped=len(prompts) - len(todo), failed=tuple(failed))


def _shared_todo(replica: Replica, folder: Optional[RunFolder], prompts: list[str]) -> list[int]:
    """Rank 0's list of prompt indices still to make (or its error), the same on every rank."""
    mine: tuple[str, Any] = ("todo", [])
    if folder is not None:
        try:
            mine = ("todo", folder.todo(prompts))
            folder.note_unrecorded(prompts)
        except ImageRunError as error:  # every rank must reach the all_gather below, whatever went wrong
            mine = ("error", str(error))
    kind, value = replica.all_gather(mine)[0]
    if kind == "error":
        raise ImageRunError(value)
    return value


def _make(replica: Replica, index: int, prompt: str, call: Mapping[str, Any], seed: int, bar) -> ImageRecord:
    """One image as PNG bytes; a failure becomes a record with its error (rank 0 reports it) so no rank hangs."""
    where = replica.group.label if replica.group is not None else (
        "the CPU" if replica.launch.distributed else "the whole machine")
    start = time.perf_counter()
    png, error = b"", None
    try:
        generator = torch.Generator("cpu").manual_seed(seed + index)
        if bar is None:
            output = replica.pipe(prompt, generator=generator, **call)
        else:
            with counting_steps(replica.pipe, bar):
                output = replica.pipe(prompt, generator=generator, **call)
        png = _png(output)
    except Exception as failure:  # gathered and reported by rank 0 with the prompt index and rank
        error = f"{type(failure).__name__}: {failure}"
    return ImageRecord(index=index, prompt=prompt, seed=seed + index, rank=replica.launch.rank, replica=where,
                       seconds=time.perf_counter() - start, png=png, error=error)


def _png(output: Any) -> bytes:
    images = getattr(output, "images", None)
    if not images:
        raise ImageRunError(f"the pipeline returned {type(output).__name__} without images; placement run writes "
                            "one image per prompt (video pipelines are not supported).")
    buffer = io.BytesIO()
    images[0].save(buffer, format="PNG")
    return buffer.getvalue()


def _stopped_line(folder: Optional[RunFolder], made: int, prompts: list[str]) -> str:
    """What rank 0 prints; the other ranks stop without a word."""
    if folder is None:
        return ""
    left = len(folder.todo(prompts))
    return (f"stopped on request after {made} new image(s): {len(prompts) - left} of {len(prompts)} are in "
            f"{str(folder.out)!r}; run the same command again to make the other {left}.")
