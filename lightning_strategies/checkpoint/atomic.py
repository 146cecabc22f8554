"""Atomic checkpoint files: a reader sees the previous complete file or the new complete file, never a torn one.

The checkpoint is written to a temporary file in the same directory (same filesystem), flushed and fsynced, then
renamed over the target (``os.replace`` is atomic on POSIX), and the directory entry is fsynced too. Sharded
checkpoint directories are written into a sibling directory and swapped in the same way (:func:`replace_directory`).
Either kind replaces the other at one path (a full save over a sharded directory, a sharded save over a full file)
by the same swap: the path holds the previous complete checkpoint until the new one is complete.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .paced_writes import open_sliced

_PARTIAL = ".partial-"


def _partial_prefix(target: Path) -> str:
    # Host and pid in the name: a later save on this host removes the files of savers that died (SIGKILL, power).
    return f".{target.name}{_PARTIAL}{socket.gethostname()}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_partials(target: Path) -> None:
    """Removes ``target``'s temporary files left by savers on this host that no longer run (killed mid-save)."""
    host = socket.gethostname()
    prefix = f".{target.name}{_PARTIAL}{host}-"
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            (target.parent / name).unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    """Makes the entries of ``directory`` (renames, new files) durable."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_torch_save(checkpoint: Any, path: str | Path, *, over_directory: bool = False) -> None:
    """``torch.save`` that replaces ``path`` only with a complete, durable file.

    The temporary file's name is unique per save (``mkstemp``), so concurrent saves to one path never write into
    each other's file; temporary files of savers on this host that were killed are removed.

    Args:
        checkpoint: What to save.
        path: The target file; its directory is created if needed.
        over_directory: Replace a directory at ``path`` (a sharded checkpoint the caller checked) by the file: swapped
            in like a sharded save (:func:`replace_directory`), so ``path`` holds the complete directory until the
            complete file takes its place.

    Raises:
        DiskFullError: The filesystem ran out of space; ``path`` is unchanged.
        IsADirectoryError: ``path`` is a directory and ``over_directory`` is not set; nothing was written.
    """
    target = Path(path)
    is_directory = target.is_dir() and not target.is_symlink()
    if is_directory and not over_directory:
        raise IsADirectoryError(
            errno.EISDIR, f"Cannot save checkpoint {str(target)!r}: a directory is there; nothing was changed."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    handle, name = tempfile.mkstemp(prefix=_partial_prefix(target), dir=target.parent)
    temporary = Path(name)
    try:
        with open_sliced(handle) as file:  # slices: a background write keeps no core for long (paced_writes)
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        if not is_directory:
            os.replace(temporary, target)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        raise_if_disk_full(error, target)
        raise
    if is_directory:  # os.replace cannot put a file over a directory: swap them (then the directory is removed)
        replace_directory(temporary, target, f"{os.getpid()}-{time.monotonic_ns()}")
        return
    fsync_directory(target.parent)  # make the rename itself durable


class DiskFullError(OSError):
    """A save ran out of disk space; the previous checkpoint at its path is unchanged."""


def _is_disk_full(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(current)
        # torch's writer reports a short write (a full disk under buffered IO) as "unexpected pos N vs M".
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def raise_if_disk_full(error: BaseException, target: Path) -> None:
    """Raises :class:`DiskFullError` (from ``error``) when ``error`` is a full disk; else returns.

    Args:
        error: What the save raised (possibly a ``DiskFullError`` about one file of ``target``).
        target: The checkpoint being saved, for the message.
    """
    if not _is_disk_full(error):
        return
    cause: BaseException = error
    while isinstance(cause, DiskFullError) and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    try:
        free = f"{shutil.disk_usage(target.parent if target.parent.exists() else Path.cwd()).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    raise DiskFullError(
        errno.ENOSPC,
        f"Saving checkpoint {str(target)!r} failed: the disk is full (No space left on device; {free}). The previous"
        f" checkpoint at that path is unchanged. Free some space (or save elsewhere) and save again. Cause:"
        f" {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}",
    ) from error


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swaps two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(first))


def replaced_name(target: Path, save_id: str) -> Path:
    """Where a directory that a save replaces waits until it is removed (found by loaders if the save died there)."""
    return target.with_name(f".{target.name}.replaced-{save_id}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_directory(staging: Path, target: Path, save_id: str) -> None:
    """Puts the complete directory (or file) ``staging`` at ``target``; what was there (a directory or a file, a
    sharded or a full checkpoint) is removed afterwards.

    With an atomic exchange (Linux) ``target`` is at every moment the previous or the new complete directory. Where
    the filesystem cannot exchange, two renames leave a short window without ``target``; the previous directory then
    waits at :func:`replaced_name`, where loaders find it (see ``resolve_sharded_directory``).
    """
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        _remove(staging)  # now what was at target: the previous directory (or a file)
    else:
        previous = replaced_name(target, save_id)
        os.rename(target, previous)
        os.rename(staging, target)
        _remove(previous)
    fsync_directory(target.parent)
