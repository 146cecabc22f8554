"""Reading checkpoint files safely: never executing code, and naming the file and the cause on failure.

A file can be read mapped (``torch.load(mmap=True)``): its tensors are then views of one private mapping of the file,
read from it page by page when used, so a rank that keeps part of each tensor touches only that part. What a mapped
checkpoint hands out must not outlive the restore: a tensor still viewing the mapping keeps the whole file mapped
(and its disk space held after the next save replaces it), and a file rewritten in place would change it. Everything
but the model and optimizer states is therefore copied into memory when read (:class:`MappedCheckpoint`), and
:func:`copy_out_of_mapping` copies what an optimizer kept of the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import mmap as _mmap
import pickle
import zipfile
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

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


#: The entries of a full checkpoint that stay mapped: the states each rank cuts its part from.
MAPPED_ENTRIES = ("state_dict", "optimizer_states")


class MappedCheckpoint(dict[str, Any]):
    """A checkpoint whose :data:`MAPPED_ENTRIES` hold tensors viewing a mapping of its file; every other entry is in
    memory. It keeps the mapping alive while it lives (one of its storages), whatever its entries become.

    Attributes:
        span: The addresses ``[start, end)`` the mapped tensors' storages occupy (``None`` when they hold none).
        file_backed: Whether ``span`` was checked to lie in one mapping of a file (``/proc/self/maps``): only then are
            pages dropped from it (:func:`release_pages`); dropping pages of ordinary memory would lose their data.
    """

    span: tuple[int, int] | None = None
    file_backed: bool = False
    _anchor: Any = None


def _in_one_file_mapping(span: tuple[int, int]) -> bool:
    """Whether ``span`` lies inside one mapping of a file of this process (Linux ``/proc/self/maps``)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[4] == "0":  # anonymous memory has inode 0 and no path
            continue
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= span[0] and span[1] <= end:
            return True
    return False


def can_map(path: str | Path) -> bool:
    """Whether ``torch.load(path, mmap=True)`` can read ``path``: a local file in torch's zip format (the legacy
    format of ``_use_new_zipfile_serialization=False`` cannot be mapped and is read whole)."""
    if "://" in str(path):
        return False
    file = Path(path)
    return file.is_file() and zipfile.is_zipfile(file)


def load_mapped(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, mapped where :func:`can_map` allows, read whole otherwise."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=can_map(path))


def _load_whole(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _tensors(value: Any) -> Iterable[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _in_memory(value: Any, inside: tuple[int, int], copies: dict[int, Tensor]) -> Any:
    """``value`` with every tensor whose storage lies in ``inside`` replaced by a copy (one copy per tensor)."""
    if isinstance(value, Tensor):
        if not _within(value, inside):
            return value
        if id(value) not in copies:
            copies[id(value)] = value.clone()
            release_pages(value)
        return copies[id(value)]
    if isinstance(value, dict):
        items = {key: _in_memory(item, inside, copies) for key, item in value.items()}
        return items if type(value) is dict else _same_kind(value, items)
    if type(value) in (list, tuple):  # other sequences (a namedtuple) are kept as they are
        return type(value)(_in_memory(item, inside, copies) for item in value)
    return value


def _same_kind(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    try:
        rebuilt: dict[Any, Any] = type(original)(items)
    except TypeError:  # a dict type that takes other arguments (defaultdict): its entries in a plain dict
        return items
    return rebuilt


def _within(tensor: Tensor, span: tuple[int, int]) -> bool:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return False
    try:
        address = tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor subclass without storage of its own: nothing loaded from a file
        return False
    return span[0] <= address < span[1]


def mapped_checkpoint(checkpoint: dict[str, Any]) -> MappedCheckpoint:
    """What ``torch.load(mmap=True)`` returned, with every entry but :data:`MAPPED_ENTRIES` copied into memory.

    Those entries are small (loops, callbacks such as ``ModelCheckpoint``'s best score, LR schedulers) and are kept by
    Lightning after the restore; the model and optimizer states are only read from.
    """
    storages = [
        tensor.untyped_storage()
        for tensor in _tensors(checkpoint)
        if tensor.device.type == "cpu" and tensor.layout == torch.strided
    ]
    storages = [storage for storage in storages if storage.nbytes() > 0]
    mapped = MappedCheckpoint()
    if storages:
        mapped.span = (min(s.data_ptr() for s in storages), max(s.data_ptr() + s.nbytes() for s in storages))
        mapped._anchor = storages[0]  # every storage is a slice of one mapping, which each keeps alive
        mapped.file_backed = _in_one_file_mapping(mapped.span)
    copies: dict[int, Tensor] = {}
    for key, value in checkpoint.items():
        mapped[key] = value if key in MAPPED_ENTRIES or mapped.span is None else _in_memory(value, mapped.span, copies)
    return mapped


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME, use_errno=True) if _LIBC_NAME else None
_PAGE = _mmap.PAGESIZE
#: The mapped checkpoint a restore is reading from (see :func:`reading_from`).
_READING: contextvars.ContextVar[MappedCheckpoint | None] = contextvars.ContextVar("reading_from", default=None)


def _drop_pages(start: int, end: int) -> None:
    """Takes the whole pages of ``[start, end)`` out of this process's resident memory (``MADV_DONTNEED``).

    For a private file mapping nothing is lost: a page used again is read from the file again. Only a page written
    to (copied on write) would lose what was written, and nothing writes into a checkpoint's mapping.
    """
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE  # inward: pages shared with neighbours stay
    if _LIBC is None or last <= first or not hasattr(_LIBC, "madvise") or not hasattr(_mmap, "MADV_DONTNEED"):
        return
    _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), ctypes.c_int(_mmap.MADV_DONTNEED))


@contextlib.contextmanager
def reading_from(checkpoint: Any) -> Generator[None, None, None]:
    """While a restore reads ``checkpoint``: :func:`release_pages` drops the pages of a mapped tensor once its part
    has been copied, and on the way out every page read from the file is dropped (the process keeps only its copies;
    without this a rank would hold the file pages of its share besides its share until the mapping goes).

    A checkpoint read into memory is left as it is.
    """
    mapped = checkpoint if isinstance(checkpoint, MappedCheckpoint) and checkpoint.file_backed else None
    token = _READING.set(mapped)
    try:
        yield None
    finally:
        _READING.reset(token)
        if mapped is not None and mapped.span is not None:
            _drop_pages(*mapped.span)


def release_pages(tensor: Tensor) -> None:
    """Drops from resident memory the pages of ``tensor``'s storage that were read from the mapped checkpoint being
    restored (:func:`reading_from`), once what a rank keeps of it has been copied out. A tensor that is not part of
    that mapping (anything in memory, a DTensor, a tensor on another device) is left alone."""
    mapped = _READING.get()
    if mapped is None or not mapped.file_backed or mapped.span is None:
        return
    if isinstance(tensor, DTensor) or tensor.device.type != "cpu":
        return
    try:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
    except RuntimeError:
        return
    end = start + storage.nbytes()
    # The mapping is alive (the checkpoint holds it), so whatever lies in its span is part of it.
    if mapped.span[0] <= start and end <= mapped.span[1]:
        _drop_pages(start, end)


def copy_out_of_mapping(optimizers: Iterable[Optimizer], checkpoint: Any) -> None:
    """Copies into memory whatever the optimizers' states and param groups still view of a mapped checkpoint.

    torch's ``Optimizer.load_state_dict`` keeps a loaded tensor that already has the parameter's dtype and device
    (``.to()`` returns it as it is), as fairscale's ``OSS`` does for the partitions a rank owns: the optimizer would
    step in the mapping (copy-on-write, but pinning the file). Nothing is done for a checkpoint read into memory.
    """
    span = checkpoint.span if isinstance(checkpoint, MappedCheckpoint) else None
    if span is None:
        return
    copies: dict[int, Tensor] = {}  # a tensor shared by two containers (OSS and its inner optimizer) stays shared
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", None)  # fairscale's OSS holds its partition in an inner optimizer
        for holder in (optimizer, *([inner] if isinstance(inner, Optimizer) else [])):
            for param, entries in list(holder.state.items()):
                holder.state[param] = _in_memory(entries, span, copies)
            for group in holder.param_groups:
                for key, value in list(group.items()):
                    if key != "params":
                        group[key] = _in_memory(value, span, copies)


def read_checkpoint(path: str | Path, load: Callable[[], Any] | None = None, *, mmap: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file with ``weights_only=True`` and checks that it is a checkpoint dictionary.

    Memory is bounded by the file's size: archives whose records unpack to more than that are refused.

    Args:
        path: The checkpoint file.
        load: Optional loader to use instead of ``torch.load`` (e.g. a ``CheckpointIO``); it must read ``path``, and
            with ``mmap`` map it where :func:`can_map` allows.
        mmap: Memory-map the tensors (``torch.load(mmap=True)``): they are read from the file when used. A file that
            cannot be mapped (the legacy non-zip format) is read whole.

    Returns:
        The checkpoint dictionary; a :class:`MappedCheckpoint` when it was mapped.

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
    mapped = mmap and can_map(path)
    try:
        checkpoint = load() if load is not None else load_mapped(file) if mapped else _load_whole(file)
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
    return mapped_checkpoint(checkpoint) if mapped else checkpoint
