"""A load is a snapshot of one save, even while another process saves over the folder.

A save replaces the whole folder in one step (`checkpoint.atomic`), but a load opens model_index.json and each
component's files at different moments, so a save landing in between would hand the load components of two
saves. The folder's version (the `_save_id` a save writes into model_index.json, plus the identity of the folder
and of that file) is read before and after the whole load. The same version at both ends means one save was in
place the whole time (a version is in place over one unbroken interval: ids are never reused); otherwise the
result is discarded and the load starts again, a few times, before a clear error.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from placement.errors import PlacementError

from ..errors import FolderChangedError
from .model_index import MODEL_INDEX_NAME, SAVE_ID_KEY

Result = TypeVar("Result")
ATTEMPTS = 5


@dataclass(frozen=True, kw_only=True)
class FolderVersion:
    save_id: str | None
    folder_inode: int
    index_inode: int
    index_mtime_ns: int


def folder_version(folder: Path) -> FolderVersion | None:
    """The version of the save in place at `folder` now (None while the folder or its index is missing)."""
    index = folder / MODEL_INDEX_NAME
    try:
        folder_stat, index_stat = os.stat(folder), os.stat(index)
        content = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable now: the read itself says why
        return None
    save_id = content.get(SAVE_ID_KEY) if isinstance(content, dict) else None
    return FolderVersion(save_id=save_id if isinstance(save_id, str) else None, folder_inode=folder_stat.st_ino,
                         index_inode=index_stat.st_ino, index_mtime_ns=index_stat.st_mtime_ns)


def read_snapshot(folder: Path, read: Callable[[], Result], *,
                  discard: Callable[[Result], object] = lambda result: None) -> Result:
    """`read()` retried until the folder's version is the same before and after it.

    An error raised while the folder changed is taken for a symptom of the change (a file gone mid-read) and
    retried too; an error raised while it stood still is the real answer and propagates as it is.
    """
    for attempt in range(ATTEMPTS):
        before = folder_version(folder)
        try:
            result = read()
        except (PlacementError, OSError):
            if before is not None and folder_version(folder) == before:
                raise
            if attempt == ATTEMPTS - 1:
                raise
            _pause(attempt)
            continue
        if before is not None and folder_version(folder) == before:
            return result
        discard(result)
        _pause(attempt)
    raise FolderChangedError(
        f"{str(folder)!r} was saved over while it was being loaded, {ATTEMPTS} times in a row, so no load could "
        "read one save's components only. Load it when no other process is saving there, or load from a copy."
    )


def _pause(attempt: int) -> None:
    time.sleep(0.01 * 2**attempt)  # let the other save finish its swap
