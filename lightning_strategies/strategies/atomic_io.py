"""The checkpoint IO plugin every strategy of ours uses by default."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_strategies.checkpoint.atomic import atomic_torch_save

from .._lightning import _PATH, TorchCheckpointIO


class AtomicTorchCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic local saves (remote paths keep fsspec's behaviour)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path) or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, path)

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
