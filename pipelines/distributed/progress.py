"""One bar for a whole `placement run`: every denoising step of every image, with the image count and an ETA.

A pipeline's `__call__` wraps its steps in `self.progress_bar(...)` (diffusers' `DiffusionPipeline` and our
`Pipeline` alike: `for t in self.progress_bar(timesteps)` or `with self.progress_bar(total=n) as bar:
bar.update()`). `counting_steps(pipe, bar)` gives the pipe, for the block, a `progress_bar` that draws nothing
and advances the run's bar instead, so one bar counts steps across images and the ETA covers the whole run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from tqdm.auto import tqdm


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
    """The run's bar: `images` x `steps` steps (tqdm shows it on terminals only, like the load bar)."""
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
