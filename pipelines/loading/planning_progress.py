"""A bar on stderr while planning takes more than a couple of seconds (the estimates of a large call): it shows
which call is being estimated and how many block calls have run. Silent when planning is quicker, when stderr is
not a terminal (tqdm's `disable=None`, as the load bar), or with `progress=False`; gone once the plan is made."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from tqdm.auto import tqdm

from placement.activations.progress import progress_reported

# Planning quicker than this prints nothing: a bar that flashes for a moment says nothing.
PLANNING_BAR_DELAY = 2.0


class _PlanningBar:
    """Tells the bar what the estimates report (`placement.activations.progress.EstimateProgress`)."""

    def __init__(self, bar: tqdm) -> None:
        self._bar = bar

    def estimating(self, label: str) -> None:
        self._bar.set_description(f"Planning: estimating {label}", refresh=False)
        self._bar.update(0)  # shown now if the delay has passed, not only at the next block

    def advanced(self) -> None:
        self._bar.update(1)


@contextmanager
def planning_progress(*, enabled: bool = True) -> Iterator[None]:
    """Within it, the estimates move a planning bar (module doc)."""
    with tqdm(desc="Planning", unit=" block calls", delay=PLANNING_BAR_DELAY, leave=False, file=sys.stderr,
              disable=None if enabled else True) as bar, progress_reported(_PlanningBar(bar)):
        yield
