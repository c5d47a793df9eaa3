"""Ctrl-C during `placement run`: finish the image being made, write it, then stop.

`stop_requests()` turns the first SIGINT (Ctrl-C) or SIGTERM (what torchrun's agent sends its workers when it
is interrupted) into a request the job checks between images; a second one, a second or more later, stops at
once (KeyboardInterrupt). Under torchrun one Ctrl-C reaches a worker twice (from the terminal, then forwarded
by the agent) within milliseconds: signals that close together count as one.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

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
    """A StopRequest that SIGINT and SIGTERM set inside the block (the previous handlers come back after).
    Off the main thread (where Python cannot install handlers) it is never set: Ctrl-C acts as usual."""
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
