"""Disk-homed weights pinned to the version a load read. A placed component homed on "disk" re-reads its weights
from the checkpoint's files at every call; another process saving over that folder (atomically: a new folder
renamed into place) would otherwise leave the running pipeline computing with a mix of both versions, a replaced
file giving another model's output and a deleted or truncated one a raw error.

Two guards, both kept:
- `pin_checkpoint_files` hard-links each file into a private folder under the offload folder at load (the same
  filesystem: no byte copied). A save's rename then changes the folder's names, never the linked inode, so the
  pipeline keeps reading the version it loaded. Where no link can be made (another filesystem, no offload folder),
  the checkpoint path is read as it is.
- Every offload-index entry carries the identity of its file as the load saw it (`file_identity`: device, inode,
  size, modification time), and `PinnedWeightsLoader` checks it before and after each read: a file that changed
  fails the call with `OffloadConflictError` naming it — never a mix, never a raw error."""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from pathlib import Path
from typing import Any, Mapping

from accelerate.utils import OffloadedWeightsLoader

from .errors import OffloadConflictError

IDENTITY_KEY = "file_identity"  # an offload-index entry's {os.stat field: value} of its file, as the load saw it
PINNED_PREFIX = ".pinned-"


def identity_now(path: str | os.PathLike, recorded: Mapping[str, int]) -> dict[str, int]:
    """The recorded stat fields of `path` as they are now (a symlink, as in the Hugging Face cache, followed)."""
    status = os.stat(path)
    return {field: getattr(status, field) for field in recorded}


def check_identity(info: Mapping[str, Any]) -> None:
    """Raise when the file of an offload-index entry is not the one the load recorded."""
    recorded = info.get(IDENTITY_KEY)
    if recorded is None:
        return
    path = info["safetensors_file"]
    try:
        now = identity_now(path, recorded)
    except FileNotFoundError:
        raise _changed(path, "it is gone (deleted, or its folder was saved over or moved)") from None
    if now != dict(recorded):
        size, then = now.get("st_size"), recorded.get("st_size")
        what = (f"it holds {size} bytes, {then} when loaded" if size != then
                else "it was replaced or rewritten since the load")
        raise _changed(path, what)


def _changed(path: str, what: str) -> OffloadConflictError:
    return OffloadConflictError(
        f"The weights homed on disk in {path!r} changed under the placed model: {what}. It reads them at every "
        "call, and computing with another version's weights would mix two models, so it stops here. Load the "
        "pipeline (or model) again to use the new version; to keep using a version while it is saved over, give "
        "the load an offload_folder on the same filesystem (its files are then hard-linked there at load)."
    )


class PinnedWeightsLoader(OffloadedWeightsLoader):
    """accelerate's loader, each file read checked against the identity the load recorded (before and after)."""

    def __getitem__(self, key: str):
        info = None if key in self.state_dict else self.index.get(key)
        if info is None or info.get("safetensors_file") is None:
            return super().__getitem__(key)
        check_identity(info)
        try:
            tensor = super().__getitem__(key)
        except Exception:  # noqa: BLE001 - a file cut or replaced mid-read says so; any other error is raised as is
            check_identity(info)
            raise
        check_identity(info)
        return tensor


def pin_checkpoint_files(index: Mapping[str, Mapping[str, Any]], offload_folder: str | os.PathLike | None, *,
                         owner: Any) -> dict[str, dict[str, Any]]:
    """`index` with each file hard-linked into a private folder of `offload_folder` where the filesystem allows,
    the link checked to be the version recorded; the folder is removed when `owner` is collected (or at exit).
    Without an offload folder, or across filesystems, the entries keep their paths (the identity check guards)."""
    pinned = {name: dict(info) for name, info in index.items()}
    if offload_folder is None:
        return pinned
    remove_dead_pinned(Path(offload_folder))
    folder = Path(offload_folder) / f"{PINNED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    links: dict[str, str] = {}
    for info in pinned.values():
        source = info["safetensors_file"]
        if source not in links:
            links[source] = _link(source, folder, number=len(links), recorded=info.get(IDENTITY_KEY))
        info["safetensors_file"] = links[source]
    if any(path.startswith(str(folder)) for path in links.values()):
        weakref.finalize(owner, shutil.rmtree, str(folder), ignore_errors=True)
    elif folder.exists():
        shutil.rmtree(folder, ignore_errors=True)  # nothing could be linked there
    return pinned


def _link(source: str, folder: Path, *, number: int, recorded: Mapping[str, int] | None) -> str:
    """A hard link to `source` in `folder` (its path), or `source` itself where none can be made."""
    target = Path(source).resolve()  # the blob behind a Hugging Face cache symlink
    link = folder / f"{number:05d}-{target.name}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.link(target, link)
    except OSError:  # another filesystem, no hard links there, a read-only offload folder: read in place
        return source
    if recorded is not None and identity_now(link, recorded) != dict(recorded):
        shutil.rmtree(folder, ignore_errors=True)  # saved over between the load's read and this link: not the
        raise _changed(source, "it was replaced while the model was loading")  # version loaded; the load fails
    return str(link)


def remove_dead_pinned(offload_folder: Path) -> None:
    """Remove the pinned folders of processes that are gone (a crash skips the cleanup at exit)."""
    if not offload_folder.is_dir():
        return
    for entry in offload_folder.glob(f"{PINNED_PREFIX}*"):
        pid = entry.name.removeprefix(PINNED_PREFIX).partition("-")[0]
        if pid.isdigit() and entry.is_dir() and not entry.is_symlink() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        pass
    return True


__all__ = ["IDENTITY_KEY", "PinnedWeightsLoader", "check_identity", "pin_checkpoint_files"]
