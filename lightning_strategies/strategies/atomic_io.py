"""The checkpoint IO plugin every strategy of ours uses by default, and how saves deal with Lightning's
``AsyncCheckpointIO`` (which writes in a background thread and returns at once)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_strategies.checkpoint.atomic import atomic_torch_save
from lightning_strategies.checkpoint.io import can_map, load_mapped, read_checkpoint
from lightning_strategies.checkpoint.remote import open_store, remove_saves, streamed_write
from lightning_strategies.checkpoint.targets import is_url, require_replaceable

from .._lightning import (
    _PATH,
    AsyncCheckpointIO,
    CheckpointIO,
    TorchCheckpointIO,
    _WrappingCheckpointIO,
    join_background_writes,
    load_file_weights_only,
    load_weights_only,
)


class AtomicTorchCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic local saves and streamed saves to stores.

    A local save replaces a previous checkpoint at its path, a file or a sharded directory (atomically, as a sharded
    save replaces a full file), and refuses anything else there
    (:class:`~lightning_strategies.checkpoint.targets.ForeignPathError`, see that module). A save to a URL streams
    ``torch.save`` into the store (``storage_options`` are the fsspec backend's: credentials, endpoint), where the
    object appears once whole; sharded saves of the same URL it replaces are removed afterwards
    (:mod:`~lightning_strategies.checkpoint.remote`).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if is_url(path):
            store = open_store(str(path), storage_options)
            streamed_write(store, partial(torch.save, checkpoint))
            remove_saves(store, keep=set())  # the sharded saves of this URL: the object is newer
            return
        if storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)  # Lightning's error: no options for local paths
            return
        target = Path(path)
        # A previous checkpoint at the path (say `last.ckpt` of a run that saved sharded, resumed with full saves) is
        # replaced, atomically; anything else is left alone (checkpoint.targets).
        require_replaceable(target, "full")
        over_directory = target.is_dir() and not target.is_symlink()
        atomic_torch_save(checkpoint, target, over_directory=over_directory)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
        *,
        mmap: bool = False,
    ) -> dict[str, Any]:
        """Loads with ``weights_only=True`` always: Lightning passes ``None`` (remote paths then unpickle anything).

        Args:
            path: The checkpoint file.
            map_location: As ``torch.load``'s.
            weights_only: ``None`` or ``True``.
            mmap: Map a local file in torch's zip format (``torch.load(mmap=True)``): its tensors are read from the
                file when used. A legacy (non-zip) or remote file is read whole.

        Raises:
            ValueError: ``weights_only=False`` was asked for; nothing in this package loads that way.
        """
        if weights_only is False:
            raise ValueError(
                f"Refusing to load {str(path)!r} with weights_only=False: unpickling arbitrary objects can run code."
                " Checkpoints of this package hold only tensors and plain values; load others with torch.load yourself."
            )
        if mmap and can_map(path):
            mapped: dict[str, Any] = load_mapped(path, map_location=map_location)
            return mapped
        return load_file_weights_only(path, map_location)


def _loading_io(io: CheckpointIO) -> CheckpointIO:
    """The plugin that really loads for ``io``: wrappers that only hand ``load_checkpoint`` on (Lightning's
    ``AsyncCheckpointIO`` writes in the background and loads through the plugin it wraps) are looked through."""
    while (
        isinstance(io, _WrappingCheckpointIO)
        and type(io).load_checkpoint is _WrappingCheckpointIO.load_checkpoint
        and io.checkpoint_io is not None
    ):
        io = io.checkpoint_io
    return io


def maps_files(io: CheckpointIO) -> bool:
    """Whether ``io`` loads a file mapped when asked: its ``load_checkpoint`` takes an ``mmap`` keyword, as
    :class:`AtomicTorchCheckpointIO`'s does (a subclass that overrides it without one, or any other plugin, is called as
    Lightning calls it)."""
    try:
        parameters = inspect.signature(io.load_checkpoint).parameters
    except (TypeError, ValueError):
        return False
    mmap = parameters.get("mmap")
    return mmap is not None and mmap.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def loads_mapped(io: CheckpointIO) -> bool:
    """Whether a restore through ``io`` reads a local full file mapped (see :func:`read_full_checkpoint`)."""
    return maps_files(_loading_io(io))


def read_full_checkpoint(path: _PATH, io: CheckpointIO) -> dict[str, Any]:
    """Reads a full checkpoint file for a restore through the strategy's checkpoint IO, with ``weights_only=True``.

    Mapped where the plugin that loads supports it (the default :class:`AtomicTorchCheckpointIO`, also under
    ``AsyncCheckpointIO``) and the file is a local one in torch's zip format: each rank then reads from the file only
    the parts of the tensors it keeps, instead of the whole file (see :func:`~lightning_strategies.checkpoint.io.
    read_checkpoint` for what stays mapped). Any other plugin, a remote path or a legacy file is read whole.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointFormatError: See :func:`~lightning_strategies.checkpoint.io.read_checkpoint`.
    """
    loader = _loading_io(io)
    if maps_files(loader) and can_map(path):
        load: Callable[..., dict[str, Any]] = loader.load_checkpoint  # its signature takes `mmap` (checked above)
        return read_checkpoint(path, load=lambda: load(path, weights_only=True, mmap=True), mmap=True)
    return read_checkpoint(path, load=lambda: load_weights_only(io.load_checkpoint, path))


def synchronous_checkpoint_io(io: CheckpointIO) -> CheckpointIO:
    """``io`` without the ``AsyncCheckpointIO`` layers around it: its writes are done when it returns.

    A sharded save writes through it: its directory is swapped in right after the writes, and a background write
    still under way then would leave the directory without that file (and the file in a staging directory that no
    loader reads).
    """
    while isinstance(io, AsyncCheckpointIO) and io.checkpoint_io is not None:
        io = io.checkpoint_io
    return io


def finish_background_writes(io: CheckpointIO) -> None:
    """Waits until every ``AsyncCheckpointIO`` in ``io``'s chain of wrappers has written what it was given.

    Raises:
        BaseException: The error of a background write that failed, as the plugin's own next save raises it (the
            plugin keeps it: its next save and its teardown raise it again).
    """
    layer: CheckpointIO | None = io
    while isinstance(layer, _WrappingCheckpointIO):
        if isinstance(layer, AsyncCheckpointIO):
            join_background_writes(layer)
        layer = layer.checkpoint_io
