"""The output folder of `placement run`: OUT/00000.png, ... by prompt index and OUT/run.json (source, call, seed,
and per image its prompt, seed, rank, GPUs, seconds, file or error).

Each file is written through a temporary file renamed into place, so a stopped run leaves whole files only; an
image run.json does not list (the run stopped between the two writes) is made again. A rerun skips the images
done; one of another source, call or seed, or holding images of other prompts, is refused unless `overwrite`.
`run_lock` makes a run OUT's only writer: an exclusive `flock` the kernel drops however the process ends (kill -9
included), so a crashed run never blocks the next, and the holder clears the temporary files a killed run left.
The lock file is opened only as a plain file of its own (never through a link), and every record replaces a link
at its name: nothing is written outside OUT."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import sys
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from ..checkpoint.saving import write_file_atomically
from ..errors import ImageRunError


RUN_FILE = "run.json"


@dataclass(frozen=True, kw_only=True)
class ImageRecord:
    index: int
    prompt: str
    seed: int
    rank: int
    replica: str  # where it ran: "GPU 0–1", "the CPU", "the whole machine"
    seconds: float
    png: bytes = b""
    error: Optional[str] = None

    @property
    def file(self) -> Optional[str]:
        return image_name(self.index) if self.error is None else None

    def entry(self) -> dict[str, Any]:
        fields = {key: value for key, value in asdict(self).items() if key != "png"}
        return {**fields, "file": self.file, "seconds": round(self.seconds, 3)}


def image_name(index: int) -> str:
    return f"{index:05d}.png"


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-blank line."""
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise ImageRunError(f"Cannot read the prompts file {str(path)!r}: {error}.") from error
    except UnicodeDecodeError as error:  # a binary file, or text saved in another encoding (Latin-1, UTF-16)
        line = error.object[: error.start].count(b"\n") + 1  # the bytes already read: no second read
        raise ImageRunError(
            f"The prompts file {str(path)!r} is not UTF-8 text (byte {error.start}, line {line}: "
            f"{error.object[error.start:error.start + 1]!r}). Save it as UTF-8, one prompt per line."
        ) from None
    if not prompts:
        raise ImageRunError(f"The prompts file {str(path)!r} has no prompt; write one prompt per line.")
    return prompts


class RunFolder:
    """OUT and its run.json: what is done, and each new image written at once (rank 0 only writes)."""

    def __init__(self, out: Path, *, source: str, call: Mapping[str, Any], seed: int, overwrite: bool):
        self.out = Path(out)
        self.header = {"source": source, "call": dict(call), "seed": seed}
        self.overwrite = overwrite
        self._entries: Optional[dict[int, dict[str, Any]]] = None
        self._noted = False  # note_unrecorded said its piece

    @property
    def entries(self) -> dict[int, dict[str, Any]]:
        """run.json's entries by prompt index (read on first use; another run's run.json is an error)."""
        if self._entries is None:
            self._entries = {} if self.overwrite else self._previous_entries()
        return self._entries

    def _previous_entries(self) -> dict[int, dict[str, Any]]:
        path = self.out / RUN_FILE
        if not path.exists():
            return {}
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
            entries = {int(entry["index"]): entry for entry in previous["images"]}
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ImageRunError(f"{str(path)!r} cannot be read ({type(error).__name__}: {error}); pass --overwrite "
                                "to start this folder afresh, or choose another --out.") from error
        changed = [f"{key} {previous.get(key)!r} (now {value!r})" for key, value in self.header.items()
                   if previous.get(key) != value]
        if changed:
            raise ImageRunError(
                f"{str(self.out)!r} holds images of another run: its run.json has {'; '.join(changed)}. Pass "
                "--overwrite to replace them, or choose another --out."
            )
        return entries

    def is_done(self, index: int, prompt: str) -> bool:
        entry = self.entries.get(index)
        return (entry is not None and entry.get("error") is None and entry.get("prompt") == prompt
                and (self.out / image_name(index)).is_file())

    def todo(self, prompts: list[str]) -> list[int]:
        self._refuse_other_prompts(prompts)
        return [index for index, prompt in enumerate(prompts) if not self.is_done(index, prompt)]

    def _refuse_other_prompts(self, prompts: list[str]) -> None:
        """Images run.json records for another prompt at the same index (another prompts file, or a run that waited
        for this one): made again, they would replace that run's images without a word."""
        changed = [f"{image_name(index)} was made for {entry.get('prompt')!r} (now {prompts[index]!r})"
                   for index, entry in sorted(self.entries.items())
                   if index < len(prompts) and entry.get("error") is None and entry.get("prompt") != prompts[index]]
        if changed:
            shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise ImageRunError(
                f"{str(self.out)!r} holds images of other prompts: {shown}. Pass --overwrite to replace them, or "
                "choose another --out to keep both.")

    def unrecorded(self, prompts: list[str]) -> list[str]:
        """Images in OUT that run.json does not list (a run stopped before recording them): their prompt and seed cannot
        be vouched for, so they are made again."""
        if self.overwrite or not self.out.is_dir():
            return []
        names = {image_name(index): index for index in range(len(prompts))}
        return sorted(entry.name for entry in self.out.iterdir()
                      if entry.name in names and names[entry.name] not in self.entries)

    def note_unrecorded(self, prompts: list[str]) -> None:
        names = [] if self._noted else self.unrecorded(prompts)
        self._noted = True
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            print(f"{len(names)} image(s) in {self.out} are not in {RUN_FILE} ({shown}): a run stopped before "
                  "recording them; they are made again.", flush=True)

    def write(self, record: ImageRecord, *, world_size: int) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise write_error(self.out, error) from error
        if record.error is None:
            write_atomically(self.out / image_name(record.index), record.png)
        self.entries[record.index] = record.entry()
        summary = {**self.header, "world_size": world_size,
                   "images": [self.entries[index] for index in sorted(self.entries)]}
        write_atomically(self.out / RUN_FILE, (json.dumps(summary, indent=2) + "\n").encode("utf-8"))


def write_atomically(path: Path, data: bytes) -> None:
    """`data` into `path`, whole or not at all (`write_file_atomically`); a failure names `path`."""
    try:
        write_file_atomically(path, data)
    except OSError as error:
        raise write_error(path, error) from error


def write_error(path: Path, error: OSError) -> ImageRunError:
    return ImageRunError(
        f"Cannot write {str(path)!r}: {error.strerror or error}. The images written before it are kept and listed "
        f"in {RUN_FILE}; fix that (free some space, or choose another --out) and run the same command again to "
        "make the rest.")


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
            handle = _open_lock_file(path)
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


def _open_lock_file(path: Path) -> int:
    """The lock file, opened without following a link and only if it is a plain file of its own: the pid is written
    into it, and a link (symbolic or hard) there would carry that write to a file outside OUT."""
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            _refuse_lock_path(path)
        raise
    status = os.fstat(handle)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        os.close(handle)
        _refuse_lock_path(path)
    return handle


def _refuse_lock_path(path: Path) -> None:
    status = os.lstat(path)
    if stat.S_ISLNK(status.st_mode):
        what = f"a symbolic link (to {os.readlink(path)!r})"
    elif stat.S_ISDIR(status.st_mode):
        what = "a folder"
    elif stat.S_ISREG(status.st_mode):
        what = f"a file with {status.st_nlink} hard links (one of them outside this run's lock)"
    else:
        what = "not a regular file"
    raise ImageRunError(
        f"{str(path)!r} is {what}: placement run keeps its lock file there and writes its pid into it, so it never "
        f"opens anything else at that name. Remove it (rm {'-r ' if what == 'a folder' else ''}{str(path)!r}) if "
        "no run is writing into this folder, or choose another --out.")


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
