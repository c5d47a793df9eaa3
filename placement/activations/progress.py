"""Who is told how far the estimates have got: planning a FLUX-size call takes seconds, a video VAE's tiled decode
longer, and a user watching a terminal should see it move. `placement` draws nothing itself (it has no terminal);
a caller that does (`pipelines`' planning bar) enters `progress_reported(listener)`, and each estimate that starts
and each block call it runs or replays tells the listener."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Protocol


class EstimateProgress(Protocol):
    def estimating(self, label: str) -> None:
        """An estimate starts: `label` says which call, e.g. "FluxTransformer2DModel.forward"."""

    def advanced(self) -> None:
        """One more block call run or replayed within the current estimate."""


_listener: ContextVar[EstimateProgress | None] = ContextVar("placement_estimate_progress", default=None)


@contextlib.contextmanager
def progress_reported(listener: EstimateProgress) -> Iterator[None]:
    """Within it, the estimates tell `listener` how far they have got."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def estimate_started(label: str) -> None:
    listener = _listener.get()
    if listener is not None:
        listener.estimating(label)


def block_called() -> None:
    listener = _listener.get()
    if listener is not None:
        listener.advanced()
