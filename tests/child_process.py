"""Running a child process (the CLI, torchrun, a docs snippet) from a test without letting the machine's speed decide
the verdict.

A child gets no tight wall-clock limit: only a hang guard, `HANG_GUARD_SECONDS` (ten minutes, more than twenty
times what the slowest child takes on an idle 2-core machine), times `PLACEMENT_TEST_TIMEOUT_SCALE` (default 1;
raise it on a machine slower or busier than that). Reaching the guard fails the test with the child's output so
far. Whatever the verdict, the child's command, exit code, stdout and stderr are echoed into the test's captured
output, which pytest shows when the test fails.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from typing import Callable

import pytest

HANG_GUARD_SECONDS = 600.0
SCALE_ENV = "PLACEMENT_TEST_TIMEOUT_SCALE"


def hang_guard(seconds: float = HANG_GUARD_SECONDS) -> float:
    """`seconds` scaled by PLACEMENT_TEST_TIMEOUT_SCALE: how long a test waits before calling a child hung."""
    text = os.environ.get(SCALE_ENV, "1")
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={text!r} is not a number (e.g. 2 waits twice as long)") from None
    return seconds * max(scale, 0.0)


def run_child(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, **kwargs)` under the hang guard, its output echoed."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=hang_guard(), **kwargs)
    except subprocess.TimeoutExpired as hung:
        echo(args, None, hung.stdout, hung.stderr)
    else:
        echo(args, done.returncode, done.stdout, done.stderr)
        return done
    pytest.fail(f"{shlex.join(args)} still ran after {hang_guard():.0f} s (hung?); its output is above. On a slow "
                f"machine set {SCALE_ENV}.", pytrace=False)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    """Wait until `condition()` holds while `process` runs; fail (with its output) if it ends first or hangs."""
    deadline = time.monotonic() + hang_guard()
    while not condition():
        if process.poll() is not None:
            stdout, stderr = process.communicate()
            echo(process.args, process.returncode, stdout, stderr)
            pytest.fail(f"the child ended (exit {process.returncode}) before {what}; its output is above",
                        pytrace=False)
        if time.monotonic() > deadline:
            process.kill()
            stdout, stderr = process.communicate()
            echo(process.args, None, stdout, stderr)
            pytest.fail(f"no {what} after {hang_guard():.0f} s (hung?); set {SCALE_ENV} on a slow machine",
                        pytrace=False)
        time.sleep(0.05)


def finish(process: subprocess.Popen) -> tuple[str, str]:
    """`process.communicate()` under the hang guard, its output echoed."""
    try:
        stdout, stderr = process.communicate(timeout=hang_guard())
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        echo(process.args, None, stdout, stderr)
        pytest.fail(f"the child still ran after {hang_guard():.0f} s (hung?); set {SCALE_ENV} on a slow machine",
                    pytrace=False)
    echo(process.args, process.returncode, stdout, stderr)
    return stdout, stderr


def echo(args, returncode: int | None, stdout: str | bytes | None, stderr: str | bytes | None) -> None:
    command = shlex.join(str(arg) for arg in args) if isinstance(args, (list, tuple)) else str(args)
    status = "still running (killed)" if returncode is None else f"exit {returncode}"
    print(f"$ {command}\n[{status}]\n--- stdout ---\n{_text(stdout)}\n--- stderr ---\n{_text(stderr)}",
          file=sys.stdout)


def _text(stream: str | bytes | None) -> str:
    if stream is None:
        return ""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream
