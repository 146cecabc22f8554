"""Reading checkpoint files safely: never executing code, and naming the file and the cause on failure."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_strategies.checkpoint.errors import CheckpointFormatError

# What torch.load raises for a file that is not a (complete) checkpoint: its unpickler fails in many ways on
# arbitrary bytes (KeyError and IndexError included).
_UNREADABLE = (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError, IndexError, TypeError)


def _require_bounded_archive(file: Path) -> None:
    """Refuses a torch zip archive whose records would unpack to more bytes than the file holds.

    torch writes records uncompressed; a crafted file with deflated records makes ``torch.load`` allocate far more
    memory than the file's size (a 1 MB file, GiBs). What is read is bounded by the file's own size.
    """
    if not zipfile.is_zipfile(file):
        return  # torch's legacy (non-zip) format: storages are read from the file itself
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise CheckpointFormatError(
            f"Checkpoint {str(file)!r} could not be read: it is truncated, corrupted or not a torch checkpoint"
            f" ({type(error).__name__}: {error})."
        ) from error
    compressed = [record.filename for record in records if record.compress_type != zipfile.ZIP_STORED]
    if compressed or sum(record.file_size for record in records) > size:
        raise CheckpointFormatError(
            f"Checkpoint {str(file)!r} is not a checkpoint torch wrote: its records unpack to more bytes than the file"
            f" holds ({', '.join(compressed[:3]) or 'declared sizes'}), which could exhaust memory. Refused."
        )


def read_checkpoint(path: str | Path, load: Callable[[], Any] | None = None, *, mmap: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file with ``weights_only=True`` and checks that it is a checkpoint dictionary.

    Memory is bounded by the file's size: archives whose records unpack to more than that are refused.

    Args:
        path: The checkpoint file.
        load: Optional loader to use instead of ``torch.load`` (e.g. a ``CheckpointIO``); it must read ``path``.
        mmap: Memory-map the tensors (``torch.load(mmap=True)``): they are read from the file when used.

    Returns:
        The checkpoint dictionary.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointFormatError: The file is empty, truncated, not a torch checkpoint, would need to run code to be
            unpickled, or does not hold a dictionary.
    """
    file = Path(path)
    if "://" not in str(path):  # remote files are checked by their CheckpointIO
        if not file.exists():
            raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
        if file.is_dir():
            raise CheckpointFormatError(
                f"Checkpoint {str(path)!r} is a directory: a sharded checkpoint, which this strategy does not read."
                f" Turn it into one full checkpoint with `lightning-strategies consolidate {path} OUT` and resume"
                " from OUT, or resume it with the strategy that wrote it."
            )
        if file.is_file() and file.stat().st_size == 0:
            raise CheckpointFormatError(
                f"Checkpoint {str(path)!r} is empty (0 bytes); the save that wrote it did not finish."
            )
        if file.is_file():
            _require_bounded_archive(file)
    try:
        checkpoint = load() if load is not None else torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointFormatError(
            f"Checkpoint {str(path)!r} holds objects that only unpickle by running code, which this package refuses"
            f" (weights_only=True). If you trust the file, load it yourself and save its tensors again. Cause: {error}"
        ) from error
    except _UNREADABLE as error:
        raise CheckpointFormatError(
            f"Checkpoint {str(path)!r} could not be read: it is truncated, corrupted or not a torch checkpoint"
            f" ({type(error).__name__}: {error})."
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointFormatError(
            f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint dictionary."
        )
    return checkpoint
