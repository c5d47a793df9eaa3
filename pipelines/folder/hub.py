"""Where a model or pipeline lives: a local folder as it is, or a Hugging Face Hub id downloaded on demand.

Only the files a load needs are fetched (`snapshot_download(allow_patterns=...)`): asking for the fp16
variant of one component never downloads the fp32 weights of the whole repository.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from ..checkpoint import WeightsNotFoundError


@dataclass(frozen=True, kw_only=True)
class HubOptions:
    """diffusers' download keywords, passed to `snapshot_download` as they are; part of every load request
    (`loading.request.LoadRequest.hub`), never carried implicitly."""

    revision: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False


def resolve_folder(
    name_or_path: str | Path,
    *,
    allow_patterns: Sequence[str] | None = None,
    subfolder: str | None = None,
    hub: HubOptions = HubOptions(),
) -> Path:
    """The local folder of `name_or_path` (joined with `subfolder`).

    An existing local path passes through untouched (never any network). Anything else must be a Hub id
    ("org/name"); it is fetched with `huggingface_hub.snapshot_download`, limited to `allow_patterns`
    (paths relative to the repository root, so they include `subfolder`), with the download options `hub`.
    """
    local = Path(name_or_path).expanduser()
    if local.exists():
        return _with_subfolder(local, subfolder)
    repo_id = str(name_or_path)
    if isinstance(name_or_path, os.PathLike) or looks_like_a_path(repo_id) or not _is_repo_id(repo_id):
        raise WeightsNotFoundError(
            f"No such folder: {repo_id!r} (looked for {str(local.absolute())!r}). Check the path; a Hugging Face "
            "Hub id is written owner/name."
        )
    given = {"token": hub.token, "cache_dir": hub.cache_dir, "local_files_only": hub.local_files_only}
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=list(allow_patterns) if allow_patterns is not None else None,
            revision=hub.revision, **{key: value for key, value in given.items() if value},
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        # huggingface_hub's own message talks of snapshots and connections only; a mistyped local path lands
        # here too, so say both what was looked for and what to check.
        raise WeightsNotFoundError(
            f"{repo_id!r} is not an existing folder (looked for {str(local.absolute())!r}), and fetching it as a "
            f"Hugging Face Hub id failed ({type(error).__name__}: {str(error).splitlines()[0]}). Check the path; "
            "for a Hub id, check its spelling, your network, and HF_TOKEN for gated or private repositories."
        ) from error
    return _with_subfolder(Path(snapshot), subfolder)


def looks_like_a_path(text: str) -> bool:
    """"./my-pipe", "my-pipe/", "/data/x", "~/x", "a/b/c", "C:\\x": a local path, never a Hub id ("name" or
    "owner/name", without a trailing slash)."""
    return text.startswith((".", "/", "~")) or text.endswith("/") or "\\" in text or text.count("/") > 1


def _is_repo_id(text: str) -> bool:
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _with_subfolder(folder: Path, subfolder: str | None) -> Path:
    path = folder / subfolder if subfolder else folder
    if not path.is_dir():
        raise WeightsNotFoundError(f"Folder {str(path)!r} does not exist (subfolder={subfolder!r}).")
    return path
