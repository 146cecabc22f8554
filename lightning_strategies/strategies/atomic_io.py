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
