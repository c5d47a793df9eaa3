"""torch says nothing while an estimate runs: its failure is ours to report, in one line.

Fake-tensor execution logs every meta kernel that raises ("failed while attempting to run meta for aten.mm",
with the whole traceback: 30-odd lines on stderr through torch's own handler) before the exception reaches us,
and some ops warn about what fake tensors do. The estimate turns the exception into an
`ActivationEstimateError` that names the component and what to do; torch's log lines and warnings for the same
event would only bury it. So for the length of the estimate the `torch` loggers are disabled and warnings
issued from torch's own modules are ignored; both are restored on exit, whatever happens.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator

_TORCH = "torch"


@contextmanager
def torch_silenced() -> Iterator[None]:
    loggers = [logging.getLogger(_TORCH)] + [
        logger for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith(_TORCH + ".") and isinstance(logger, logging.Logger)
    ]
    was_disabled = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            yield
    finally:
        for logger, disabled in zip(loggers, was_disabled):
            logger.disabled = disabled
