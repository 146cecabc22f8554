"""The checkpoint IO plugin every strategy of ours uses by default, and how saves deal with Lightning's
``AsyncCheckpointIO`` (which writes in a background thread and returns at once)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_strategies.checkpoint.atomic import atomic_torch_save
from lightning_strategies.checkpoint.sharded import is_sharded_checkpoint

from .._lightning import _PATH, AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO, _WrappingCheckpointIO


class AtomicTorchCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic local saves (remote paths keep fsspec's behaviour).

    A local save replaces a sharded checkpoint directory at its path (atomically, as a sharded save replaces a full
    file) and refuses any other directory there (``IsADirectoryError``).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path) or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        # A sharded checkpoint at the path (say `last.ckpt` of a run that saved sharded, resumed with full saves) is
        # replaced as upstream's FSDP strategies replace it, but atomically; any other directory is left alone.
        over_directory = target.is_dir() and not target.is_symlink()
        if over_directory and not is_sharded_checkpoint(target):
            raise IsADirectoryError(
                errno.EISDIR,
                f"Cannot save the full checkpoint {str(target)!r}: a directory is there that is not a sharded"
                " checkpoint (it has no meta.pt), so it is not replaced; nothing was changed. Save to another path"
                " or remove the directory.",
            )
        atomic_torch_save(checkpoint, target, over_directory=over_directory)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Loads with ``weights_only=True`` always: Lightning passes ``None`` (remote paths then unpickle anything).

        Raises:
            ValueError: ``weights_only=False`` was asked for; nothing in this package loads that way.
        """
        if weights_only is False:
            raise ValueError(
                f"Refusing to load {str(path)!r} with weights_only=False: unpickling arbitrary objects can run code."
                " Checkpoints of this package hold only tensors and plain values; load others with torch.load yourself."
            )
        loaded: dict[str, Any] = super().load_checkpoint(path, map_location=map_location, weights_only=True)
        return loaded


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
            layer.teardown()  # joins its writer thread; the next write starts a new one
        layer = layer.checkpoint_io
