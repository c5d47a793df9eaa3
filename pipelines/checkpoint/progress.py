"""Load progress in bytes: one bar over a whole pipeline load, labelled with the component being read.

`load_progress(total_bytes, enabled=...)` opens the overall bar (the pipeline loader does, around all its
components); `reading(label)` is what `load_weights` reports to: the overall bar relabelled "Loading
text_encoder_2" when one is open, else a bar of its own for that one model (a model-level load).
Bytes, not tensors: a 2 GB embedding and a 4 KB bias are not the same amount of waiting.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from tqdm.auto import tqdm

_OVERALL: ContextVar["tqdm | None"] = ContextVar("load_progress", default=None)


def _bar(total: int, label: str, enabled: bool) -> tqdm:
    # disable=None: tqdm shows the bar on terminals and notebooks only (quiet in CI logs and tests).
    return tqdm(total=total, desc=f"Loading {label}", unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True)


@contextmanager
def load_progress(total_bytes: int, *, enabled: bool, label: str = "pipeline") -> Iterator[tqdm]:
    """One bar for everything `load_weights` reads inside the block."""
    bar = _bar(total_bytes, label, enabled)
    token = _OVERALL.set(bar)
    try:
        with bar:
            yield bar
    finally:
        _OVERALL.reset(token)


@contextmanager
def reading(label: str, total_bytes: int, *, enabled: bool) -> Iterator[tqdm]:
    """The bar that `total_bytes` of `label` advance: the overall one, relabelled, or a new one."""
    overall = _OVERALL.get()
    if overall is not None:
        overall.set_description(f"Loading {label}")
        yield overall
        return
    with _bar(total_bytes, label, enabled) as bar:
        yield bar
