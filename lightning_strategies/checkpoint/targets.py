"""What a save may replace, and what a removal may remove: only checkpoints, never a user's own files.

A save writes a complete checkpoint beside its path and swaps it in, so whatever was at the path is gone afterwards.
That is right for the previous checkpoint (``last.ckpt`` saved again, a sharded save over a full file and back), and
data loss for anything else: a directory of notes a user pointed ``save_checkpoint`` at, a data file whose name was
mistyped. One rule, for every strategy, both formats, synchronous and asynchronous saves, ``ModelCheckpoint``'s
removals and the command line's ``--force``: **a path is replaced or removed only when it holds no file that a
checkpoint writer did not write** -- nothing, an empty directory, a checkpoint file (torch's zip format or its legacy
format, whoever wrote it), or a sharded checkpoint directory (``meta.pt`` or DCP's ``.metadata``) whose every entry is
a checkpoint's file. A symbolic link is judged by what it points to (a dangling one holds nothing); replacing it
replaces the link, never its target.
"""

from __future__ import annotations

import errno
import os
import re
import zipfile
from pathlib import Path
from typing import IO, Final, Literal

from lightning_strategies.checkpoint.errors import StoreError

#: The entries a sharded checkpoint directory holds: ours (``meta.pt``, fsdp_fairscale's ``rank<r>.pt``) and
#: ``torch.distributed.checkpoint``'s (``.metadata``, ``__<rank>_<n>.distcp``), as upstream Lightning writes them too.
CHECKPOINT_DIRECTORY_ENTRIES: Final = re.compile(r"^(meta\.pt|rank\d+\.pt|\.metadata|__\d+_\d+\.distcp)$")
# torch.save's legacy (non-zip) files start with a pickled magic number (protocol 2, LONG1 0x1950a86a20f9469cfc6c).
_LEGACY_MAGIC: Final = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
_FOREIGN_SHOWN: Final = 3

SaveKind = Literal["full", "sharded"]


class ForeignPathError(FileExistsError):
    """A save's path (or a removal's) holds something that is not a checkpoint; nothing was changed."""


#: A save's refusal as rank 0 tells every rank of it: which error, and its message.
SaveRefusal = tuple[Literal["foreign path", "store"], str]


def refusal_error(refusal: SaveRefusal) -> Exception:
    """The exception every rank raises for rank 0's ``refusal``."""
    kind, message = refusal
    if kind == "store":
        return StoreError(message)
    return ForeignPathError(errno.EEXIST, message)


def is_checkpoint_file(path: Path) -> bool:
    """Whether the regular file ``path`` is in one of ``torch.save``'s formats (zip with a ``data.pkl``, or legacy)."""
    try:
        with path.open("rb") as file:
            return is_checkpoint_stream(file)
    except OSError:
        return False


def is_checkpoint_stream(file: IO[bytes]) -> bool:
    """Whether the seekable binary ``file`` (local or a store's) is in one of ``torch.save``'s formats."""
    try:
        if file.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC:
            return True
        file.seek(0)
        if not zipfile.is_zipfile(file):
            return False
        file.seek(0)
        with zipfile.ZipFile(file) as archive:
            return any(name == "data.pkl" or name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _foreign_entries(directory: Path) -> list[str] | None:
    """The entries of ``directory`` that no checkpoint writer wrote (sorted), or ``None`` when it is unreadable."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    foreign = []
    for name in names:
        entry = directory / name
        regular = entry.is_file() and not entry.is_symlink()
        if not (regular and CHECKPOINT_DIRECTORY_ENTRIES.match(name)):
            foreign.append(name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    return foreign


def _what_is_there(path: Path) -> str | None:
    """``None`` when ``path`` holds nothing but checkpoint files; else what is there that is not, for a message."""
    if path.is_symlink():
        if not path.exists():
            return None  # a dangling link holds no data: replacing it removes only the link
        target = path.resolve()
        what = _what_is_there(target)
        return None if what is None else f"a symbolic link to {str(target)!r}, which holds {what}"
    if not path.exists():
        return None
    if path.is_file():
        return None if is_checkpoint_file(path) else "a file that is not a checkpoint (not in torch.save's format)"
    if not path.is_dir():
        return "something that is neither a file nor a directory"
    foreign = _foreign_entries(path)
    if foreign is None:
        return "a directory that cannot be listed"
    if not foreign:
        return None  # empty, or only a checkpoint's files
    shown = ", ".join(foreign[:_FOREIGN_SHOWN]) + (
        f" and {len(foreign) - _FOREIGN_SHOWN} more" if len(foreign) > _FOREIGN_SHOWN else ""
    )
    names = "meta.pt, rank<r>.pt, .metadata, __<r>_<n>.distcp"
    return f"a directory with files no checkpoint writes ({shown}; a checkpoint directory holds only {names})"


def replace_problem(path: str | Path, kind: SaveKind) -> str | None:
    """Why a ``kind`` save must not replace what is at the local ``path``, or ``None`` when it may.

    Args:
        path: The save's target (a local path).
        kind: ``"full"`` (one file) or ``"sharded"`` (a directory), for the message.

    Returns:
        The refusal's message, naming the path, what is there and the fix; ``None``: nothing there, or a checkpoint.
    """
    target = Path(path)
    what = _what_is_there(target)
    if what is None:
        return None
    return (
        f"Cannot save the {kind} checkpoint {str(target)!r}: the path holds {what}. A save replaces only a previous"
        " checkpoint, so that no file it did not write is lost; nothing was changed. Save to another path (for"
        f" example a new directory inside it: {str(target / 'checkpoint')!r}), or move those files away."
    )


def require_replaceable(path: str | Path, kind: SaveKind) -> None:
    """Raises :class:`ForeignPathError` unless a ``kind`` save may replace what is at the local ``path``.

    Raises:
        ForeignPathError: See :func:`replace_problem`.
    """
    problem = replace_problem(path, kind)
    if problem is not None:
        raise ForeignPathError(errno.EEXIST, problem)


def removal_problem(path: str | Path) -> str | None:
    """Why removing the local ``path`` (a checkpoint ``ModelCheckpoint`` no longer keeps) would lose a user's file, or
    ``None`` when it holds only a checkpoint's files (or nothing)."""
    what = _what_is_there(Path(path))
    if what is None:
        return None
    return (
        f"Not removing {str(path)!r}: it holds {what}, not only a checkpoint's files. Remove it yourself if unneeded."
    )


def same_checkpoint_path(first: str | Path, second: str | Path) -> bool:
    """Whether two checkpoint paths name the same checkpoint: URLs compared as written (less a trailing ``/``),
    local paths once made absolute with their links resolved."""
    first_text, second_text = str(first), str(second)
    if "://" in first_text or "://" in second_text:
        return first_text.rstrip("/") == second_text.rstrip("/")
    return os.path.realpath(first_text) == os.path.realpath(second_text)


def is_url(path: str | Path) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/key``, ``memory://x``) rather than a local path."""
    return "://" in str(path)
