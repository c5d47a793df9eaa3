"""One `placement run` at a time per output folder.

Two runs writing into one OUT would each record only its own images in run.json, and the last writer's run.json
would hide the other's images. `run_lock(out)` holds an exclusive `flock` on OUT/.placement-run.lock (holding the
holder's pid) while a run writes there: a second run is refused with that pid, or waits for it (`wait=True`,
`placement run --wait`). The kernel drops the lock when its process ends, however it ends (kill -9 included), so a
crashed run never blocks the next one; the file itself is removed by the run that held it.

While it holds the lock a run is OUT's only writer, so it removes the temporary files a killed run left behind
(`.00003.png.<pid>.<random>.tmp`, see `images.write_atomically`).
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from ..errors import ImageRunError
from .images import write_error

LOCK_NAME = ".placement-run.lock"
_TEMPORARY = re.compile(r"^\.(\d{5}\.png|run\.json)\..+\.tmp$")


@contextmanager
def run_lock(out: Path, *, wait: bool) -> Iterator[None]:
    """OUT (made if absent) held by this process for the block; removed again if the block left it empty."""
    out = Path(out)
    created = not out.exists()
    handle = _acquire(out, wait=wait)
    try:
        _remove_temporaries(out)
        yield
    finally:
        (out / LOCK_NAME).unlink(missing_ok=True)
        os.close(handle)
        if created:
            with suppress(OSError):  # not empty (images, or the lock file of a run that waited): kept
                out.rmdir()


def _acquire(out: Path, *, wait: bool) -> int:
    path = out / LOCK_NAME
    announced = False
    while True:
        try:  # again after a wait: the run waited for may have removed the folder it made
            out.mkdir(parents=True, exist_ok=True)
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as error:
            raise write_error(out, error) from error
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            if not wait:
                os.close(handle)
                raise ImageRunError(
                    f"{str(out)!r} is being written by another placement run ({holder}); let it finish, pass --wait "
                    "to wait for it, or choose another --out.") from None
            if not announced:
                print(f"Waiting for another placement run ({holder}) to finish writing into {out} ...",
                      file=sys.stderr, flush=True)
                announced = True
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)
            except BaseException:  # Ctrl-C while waiting: KeyboardInterrupt, said by the CLI
                os.close(handle)
                raise
        if _still_the_lock_file(handle, path):
            os.ftruncate(handle, 0)
            os.write(handle, f"{os.getpid()}\n".encode())
            return handle
        os.close(handle)  # the holder removed the file as it finished: lock the one there now


def _still_the_lock_file(handle: int, path: Path) -> bool:
    try:
        return os.fstat(handle).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(handle: int) -> str:
    text = os.pread(handle, 32, 0).decode(errors="replace").strip()
    return f"pid {text}" if text.isdigit() else "a process that is starting"


def _remove_temporaries(out: Path) -> None:
    for entry in out.iterdir():
        if _TEMPORARY.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)
