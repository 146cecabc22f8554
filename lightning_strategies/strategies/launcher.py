"""Fork/spawn launcher that hands the trained weights back to the main process in canonical form.

Upstream's launcher sends ``lightning_module.state_dict()`` from local rank 0 and loads it with ``strict=False``.
With a sharding wrapper that state holds flat shards or nothing, and the non-strict load silently moves nothing
back. Here every rank joins the strategy's canonical gather and global rank 0 sends the full state.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Literal

from .._lightning import TrainerFn, _MultiProcessingLauncher, _WorkerOutput, pl

if TYPE_CHECKING:
    from .base import DirectReferenceStrategy
from typing_extensions import override


class CanonicalStateLauncher(_MultiProcessingLauncher):
    """A ``_MultiProcessingLauncher`` whose workers return the strategy's canonical model state.

    Args:
        strategy: The strategy whose workers it launches.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    """

    def __init__(self, strategy: DirectReferenceStrategy, start_method: Literal["spawn", "fork", "forkserver"]) -> None:
        super().__init__(strategy, start_method=start_method)
        self._direct_strategy = strategy

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        # Taken by every rank in the strategy's teardown, while the wrapper could still gather it.
        weights = self._direct_strategy.take_final_model_state() if fitting else {}
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if fitting and self._strategy.is_global_zero:
            # A fresh directory per run: the filesystem may be shared between nodes.
            weights_path = os.path.join(tempfile.mkdtemp(), "weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(weights, weights_path)
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
