"""What the commands share: exit codes, errors that carry one, output paths, progress over tensors.

Nothing here imports Lightning: ``inspect``, ``convert`` and ``consolidate`` work with torch alone.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Final

from lightning_strategies.checkpoint.targets import is_checkpoint_file

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # a check failed, or a checkpoint cannot be repaired
EXIT_USAGE: Final = 2  # bad arguments (argparse uses the same code)


class CommandError(Exception):
    """Ends a command with a message for the person who ran it and an exit code.

    Args:
        message: What is wrong and how to fix it.
        exit_code: ``EXIT_FAILED`` (default) or ``EXIT_USAGE``.
    """

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(CommandError):
    """Bad arguments: a missing input, an output that would overwrite something, an unknown name (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


def existing_input(path: Path, *, directory: bool | None = None) -> Path:
    """Checks that an input path exists (and is a directory or a file when asked).

    Raises:
        UsageError: It does not exist or has the wrong kind.
    """
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist.")
    if directory is True and not path.is_dir():
        raise UsageError(f"{str(path)!r} is a file; this command takes a sharded checkpoint directory.")
    if directory is False and path.is_dir():
        raise UsageError(
            f"{str(path)!r} is a directory (a sharded checkpoint?); this command takes one checkpoint file."
            f" Turn a sharded checkpoint into one file with `lightning-strategies consolidate {path} OUT`."
        )
    return path


def writable_output(out: Path, source: Path, *, force: bool) -> Path:
    """Checks that writing ``out`` never touches the input and never replaces a file unless ``force``.

    Raises:
        UsageError: ``out`` is the input, lies inside it, is a directory, or exists and ``force`` is not set.
    """
    resolved, resolved_source = out.resolve(), source.resolve()
    if resolved == resolved_source or (out.exists() and source.exists() and out.samefile(source)):
        raise UsageError(f"OUT {str(out)!r} is the input itself; choose another path (the input is never changed).")
    if resolved_source in resolved.parents:
        raise UsageError(f"OUT {str(out)!r} lies inside the input {str(source)!r}; write it somewhere else.")
    if out.is_dir():
        raise UsageError(f"OUT {str(out)!r} is a directory; give the path of the file to write.")
    if out.exists() and not force:
        raise UsageError(f"OUT {str(out)!r} exists; pass --force to replace it, or choose another path.")
    if out.exists() and not is_checkpoint_file(out):  # --force replaces a checkpoint, never a user's other files
        raise UsageError(
            f"OUT {str(out)!r} exists and is not a checkpoint (not in torch.save's format), so --force does not replace"
            " it; nothing was written. Choose another path, or move that file away."
        )
    return out


class Progress:
    """A progress bar over tensors on stderr: tqdm when installed and stderr is a terminal, else silent.

    Args:
        total: How many tensors will be produced.
        description: What is being done, e.g. ``"consolidating"``.
        enabled: ``False`` shows nothing.
    """

    def __init__(self, total: int, description: str, enabled: bool = True) -> None:
        self._bar: Any = None
        if enabled:
            try:
                tqdm: Any = importlib.import_module("tqdm").tqdm
            except ImportError:  # tqdm comes with Lightning, which these commands do not need
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=description, unit="tensor", file=sys.stderr, disable=None)

    def advance(self, count: int = 1) -> None:
        """Counts ``count`` more tensors done."""
        if self._bar is not None:
            self._bar.update(count)

    def close(self) -> None:
        """Ends the bar."""
        if self._bar is not None:
            self._bar.close()


def human_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
