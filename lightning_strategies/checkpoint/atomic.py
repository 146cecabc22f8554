"""Atomic checkpoint files: a reader sees the previous complete file or the new complete file, never a torn one.

The checkpoint is written to a temporary file in the same directory (same filesystem), flushed and fsynced, then
renamed over the target (``os.replace`` is atomic on POSIX), and the directory entry is fsynced too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def atomic_torch_save(checkpoint: Any, path: str | Path) -> None:
    """``torch.save`` that replaces ``path`` only with a complete, durable file.

    Args:
        checkpoint: What to save.
        path: The target file; its directory is created if needed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)
