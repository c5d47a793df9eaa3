"""Write weights as safetensors (sharded past `max_shard_size`), and the one atomic save of models and pipelines.

A save writes a fresh staging folder beside the target, then links in every old entry it neither wrote nor
owns (other variants, a README survive) and swaps the staging folder into place: a failed save leaves the
target as it was, and a writer truncating a file only ever touches a new one, never a file a concurrent load
maps. A regular file and the working folder are never targets. Staging folders carry their pid, so one left by
a killed save is removed by the next save once that process is gone."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import save_file

from placement.sizes import parse_size

from ..errors import CheckpointSaveError, list_names
from .files import DIFFUSERS_WEIGHTS_NAME, WeightsNaming


Owned = Callable[[str], bool]  # relative posix path of an entry -> True when the save replaces it wholesale


def never(_path: str) -> bool:
    return False


@contextmanager
def atomic_folder(target: str | Path, *, rewrites: Owned = never) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces `target`, carrying over what the save left alone.

    `rewrites(path)` ("/"-separated, relative to the target) names old entries the save owns: dropped even when
    not rewritten (a sharded checkpoint re-saved as one file must not keep its old index)."""
    target = check_target(target)
    staging = target.parent / f".{target.name}.saving-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(target)
        staging.mkdir()
    except OSError as error:
        raise _save_error(target, error) from error
    try:
        yield staging
        if target.is_dir():
            carry_over(target, staging, rewrites)
        _swap_into_place(staging, target)
    except CheckpointSaveError as error:
        if is_write_error(error.__cause__):  # a nested save (a component's) inside our staging folder
            raise _save_error(target, error.__cause__, staging) from error.__cause__
        raise
    except Exception as error:  # noqa: BLE001 - only write errors are translated; the rest propagate as they are
        if not is_write_error(error):
            raise
        raise _save_error(target, error, staging) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone on success (renamed) or holding the old folder


def check_target(target: str | Path) -> Path:
    """The absolute target, after refusing a regular file and the working folder (or one of its parents)."""
    target = Path(target).absolute()
    if target.is_symlink():  # save into the folder it points to; replacing the link would orphan that folder
        target = target.resolve()
    if target.exists() and not target.is_dir():
        raise CheckpointSaveError(
            f"Cannot save into {str(target)!r}: it exists and is not a folder. Choose another path, or remove "
            "the file first."
        )
    resolved, cwd = target.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise CheckpointSaveError(
            f"Cannot save into {str(target)!r}: it is (or contains) the current working folder {str(cwd)!r}, which "
            "the atomic save would replace under the running process. Save to another path, or change folder "
            "(os.chdir) first."
        )
    return target


def carry_over(old: Path, new: Path, rewrites: Owned, prefix: str = "") -> None:
    """Link every entry of `old` that `new` lacks and `rewrites` does not own; merge folders both have."""
    for entry in old.iterdir():
        relative = f"{prefix}{entry.name}"
        destination = new / entry.name
        if destination.exists() or destination.is_symlink():
            if entry.is_dir() and not entry.is_symlink() and destination.is_dir():
                carry_over(entry, destination, rewrites, prefix=f"{relative}/")
            continue  # the new save wrote it: the new one wins
        if rewrites(relative):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, destination, copy_function=_link_or_copy, symlinks=True)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        else:
            _link_or_copy(entry, destination)


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links: copy instead
        shutil.copy2(source, destination)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Put `staging` at `target`: in one renameat2 exchange where Linux offers it (a concurrent load sees the old or
    the new folder), else two renames, undone if the second fails. The old folder ends up at `staging`."""
    if not target.exists():
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        return
    backup = target.parent / f".{target.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(backup, target)
        raise
    os.rename(backup, staging)  # the caller's cleanup removes it: one place, no second hidden folder


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one system call (Linux >= 3.15); False where unsupported (then rename twice)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    return result == 0


def write_file_atomically(path: str | Path, data: bytes) -> Path:
    """`data` into the file `path` through a temporary sibling, flushed to disk and renamed over it: a reader, a
    crash or a full disk sees the old file or the new one, never a part, and a link at `path` is replaced, never
    followed. The file gets the umask's mode (not mkstemp's 0600). A failure removes the temporary file and raises
    the OSError with `path` as its file name."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename != str(path):
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        raise
    return path


WRITE_ERRORS = (OSError, SafetensorError)
# How Rust's std::io::Error shows an OS error: "File too large (os error 27)".
_RUST_OS_ERROR = re.compile(r"\(os error \d+\)|Os \{ code: \d+")


def is_write_error(error: BaseException | None) -> bool:
    """`OSError`, `SafetensorError`, or an OS error in Rust's words (the tokenizers library raises a bare Exception)."""
    if isinstance(error, WRITE_ERRORS):
        return True
    return isinstance(error, Exception) and bool(_RUST_OS_ERROR.search(str(error)))


def _save_error(target: Path, error: Exception, staging: Path | None = None) -> CheckpointSaveError:
    if isinstance(error, OSError):
        cause = f"{error.strerror or error} ({type(error).__name__}{f', errno {error.errno}' if error.errno else ''})"
        if error.filename and staging is not None and str(error.filename).startswith(str(staging)):
            cause += f" writing {str(error.filename)[len(str(staging)) + 1:]!r}"  # the path it would have had
    else:  # a Rust writer (safetensors, tokenizers) wraps the OS error in its own words ("... (os error 28)")
        cause = f"{error} ({type(error).__module__.partition('.')[0]})"
    return CheckpointSaveError(
        f"Saving to {str(target)!r} failed: {cause}. The folder there is unchanged. Free disk space or fix the "
        "permissions, then save again."
    )


def remove_dead_staging(target: Path) -> list[Path]:
    """Remove `target`'s staging folders whose saving process is gone; a live one's (a concurrent save) stays."""
    removed = []
    for entry in target.parent.glob(f".{target.name}.saving-*"):
        pid = entry.name.removeprefix(f".{target.name}.saving-").partition("-")[0]
        if entry.is_dir() and not entry.is_symlink() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: someone else's process, alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


DEFAULT_MAX_SHARD_SIZE = "10GB"  # diffusers' default


def save_weights(state_dict: Mapping[str, torch.Tensor], folder: str | Path, *,
                 weights_name: str = DIFFUSERS_WEIGHTS_NAME, variant: str | None = None,
                 max_shard_size: int | str | None = None,
                 offloaded: Mapping[str, torch.Tensor] | None = None) -> list[Path]:
    """Write `state_dict` into the existing `folder`; returns the files written, index last. `offloaded` serves
    `meta` placeholders (`hooks.gather.offloaded_weights`), read shard by shard: one shard of them in memory."""
    folder = Path(folder)
    naming = WeightsNaming(weights_name=weights_name, variant=variant)
    offloaded = {} if offloaded is None else offloaded
    tensors = _checked_tensors(state_dict, offloaded)
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if limit <= 0:
        raise CheckpointSaveError(f"max_shard_size must be positive, got {max_shard_size!r}.")
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=naming.shard_pattern, max_shard_size=limit)
    written = []
    for filename, names in split.filename_to_tensors.items():
        path = folder / filename
        shard = {name: offloaded[name].contiguous() if tensors[name].is_meta else tensors[name] for name in names}
        save_file(shard, str(path), metadata={"format": "pt"})
        del shard  # the offloaded weights read for this shard go before the next shard's are read
        written.append(path)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        index_path = folder / naming.index_file
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(index_path)
    return written


def _checked_tensors(state_dict: Mapping[str, torch.Tensor],
                     offloaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    on_meta = [name for name, tensor in state_dict.items() if tensor.is_meta and name not in offloaded]
    if on_meta:
        raise CheckpointSaveError(
            f"Cannot save {list_names(on_meta)}: they are on the meta device and nothing serves them (never "
            "loaded). Load the model's weights (from_pretrained) before saving."
        )
    owners: dict[tuple, str] = {}
    shared = []
    for name, tensor in state_dict.items():
        if tensor.numel() == 0 or tensor.is_meta:  # a placeholder has no memory to share
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if key in owners:
            shared.append(f"{name} (shares memory with {owners[key]})")
        owners.setdefault(key, name)
    if shared:
        raise CheckpointSaveError(
            f"Tensors share memory: {', '.join(shared)}. safetensors stores each tensor once; declare them in "
            "the model's `_tied_weights_keys` ({tied name: source name}) so the tied copy is not saved."
        )
    return {name: tensor.detach() if tensor.is_meta else tensor.detach().contiguous()
            for name, tensor in state_dict.items()}

