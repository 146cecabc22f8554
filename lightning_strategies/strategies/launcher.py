"""Fork/spawn launcher that hands the trained weights back to the main process in canonical form.

Upstream's launcher sends ``lightning_module.state_dict()`` from local rank 0 and loads it with ``strict=False``.
With a sharding wrapper that state holds flat shards or nothing, and the non-strict load silently moves nothing
back. Here every rank joins the strategy's canonical gather and global rank 0 sends the full state.

When a run fails, torch reports the error of whichever worker it happens to notice first; often that is a peer whose
collective broke because the failing rank went away ("Connection closed by peer"). Each worker that raises records
when and what it raised, and the error the caller gets starts with the rank that raised first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

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
        self._errors_dir: str | None = None

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self._errors_dir = tempfile.mkdtemp(prefix="lightning_strategies_errors_")
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except (ProcessRaisedException, ProcessExitedException) as error:
            first = _first_failure(Path(self._errors_dir))
            if first is None or first[0] == error.error_index:
                raise
            index, pid, text = first
            raise ProcessRaisedException(
                f"\n\n-- Process {index} raised first, with the following error:\n{text}\n-- Then:{error}", index, pid
            ) from error
        finally:
            shutil.rmtree(self._errors_dir, ignore_errors=True)
            self._errors_dir = None

    @override
    def _wrapping_function(self, process_idx: int, *args: Any) -> None:
        try:
            super()._wrapping_function(process_idx, *args)
            # The worker is done (its results are queued, every rank passed teardown's barrier). Leaving the process
            # group to the interpreter's exit let a spawned worker abort now and then ("terminate called without an
            # active exception", SIGABRT) while its gloo threads were torn down.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except BaseException:
            if self._errors_dir is not None:
                record = {"time": time.time(), "pid": os.getpid(), "traceback": traceback.format_exc()}
                Path(self._errors_dir, f"{process_idx}.json").write_text(json.dumps(record))
            raise

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


def _first_failure(directory: Path) -> tuple[int, int, str] | None:
    """Process index, pid and traceback of the worker that raised first, from the records in ``directory``."""
    records = []
    for path in directory.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a worker killed while writing its record
        records.append((float(record["time"]), int(path.stem), int(record["pid"]), str(record["traceback"])))
    if not records:
        return None
    _, index, pid, text = min(records)
    return index, pid, text
