"""Fork/spawn launcher that hands the end of fit back to the main process in canonical form.

Upstream's launcher sends ``lightning_module.state_dict()`` from local rank 0 and loads it with ``strict=False``.
With a sharding wrapper that state holds flat shards or nothing, and the non-strict load silently moves nothing
back. Here every rank joins the strategy's canonical gather at the end of fit (in the strategy's teardown, while the
wrapper still exists) and global rank 0 sends the full weights. With ``hand_back="checkpoint"`` (the default) it also
sends the rest of the checkpoint it would write at that moment (optimizer and LR-scheduler states, loops, callbacks,
precision plugin), and ``trainer.save_checkpoint(path)`` in the main process writes that complete checkpoint.

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
from typing import Any, Literal, Protocol

import torch
import torch.distributed
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException
from typing_extensions import override

from lightning_strategies.checkpoint import CheckpointMetadata, to_module_keys
from lightning_strategies.checkpoint.training_state import complete_with_end_of_fit_state

from .._lightning import (
    ParallelStrategy,
    TrainerFn,
    _distributed_is_initialized,
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
    _WorkerOutput,
    dump_checkpoint,
    launched_strategy,
    load_weights_only,
    pl,
    reopen_callback_filesystems,
)
from .atomic_io import synchronous_checkpoint_io
from .meta_init import has_meta_tensors, materialise_meta_tensors
from .store_saves import prepare_store_checkpoints

#: What a fork/spawn fit hands back to the main process: the whole end-of-fit checkpoint, or the weights only.
HandBack = Literal["checkpoint", "weights"]
HAND_BACK_OPTIONS: tuple[HandBack, ...] = ("checkpoint", "weights")

# The entry of the workers' ``extra`` results that names the file with the end-of-fit training state.
_TRAINING_STATE_PATH = "lightning_strategies_training_state_path"


class CanonicalStateSource(Protocol):
    """What the launcher needs from its strategy besides Lightning's ``ParallelStrategy`` interface."""

    def full_model_state(self) -> dict[str, Any]:
        """Canonical model state on global rank 0, ``{}`` elsewhere (a collective)."""

    def checkpoint_metadata(self) -> CheckpointMetadata:
        """The metadata block the strategy writes (its ``state_dict_type`` says whether saves are canonical)."""


class CanonicalStateLauncher(_MultiProcessingLauncher):
    """A ``_MultiProcessingLauncher`` whose workers hand the end of fit back to the main process in canonical form.

    Args:
        strategy: The strategy whose workers it launches.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        source: The strategy's canonical state (the same object as ``strategy``).
        hand_back: ``"checkpoint"``: the main process gets the weights and every other part of the checkpoint rank 0
            would write at the end of fit (one canonical copy of the optimizer states is kept in the main process
            until the next fit). ``"weights"``: the weights only, as upstream; saves in the main process then hold
            no optimizer state.
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        start_method: Literal["spawn", "fork", "forkserver"],
        source: CanonicalStateSource,
        hand_back: HandBack = "checkpoint",
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self._source = source
        self._hand_back = hand_back
        self._errors_dir: str | None = None
        #: Whether the workers of the last launch failed (read in the main process).
        self.workers_failed = False
        # In a worker, from the strategy's teardown until the results are sent: canonical weights and the rest of the
        # end-of-fit checkpoint (rank 0 only). In the main process after a fit: the rest of that checkpoint.
        self._end_of_fit_weights: dict[str, Any] = {}
        self._end_of_fit_state: dict[str, Any] | None = None

    @property
    def _launched_strategy(self) -> ParallelStrategy:
        return launched_strategy(self)

    @property
    def end_of_fit_state(self) -> dict[str, Any] | None:
        """In the main process after a fit: what rank 0 would have saved at its end, except the weights."""
        return self._end_of_fit_state

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:  # in the main process, before ckpt_path="last" is resolved (errors arrive unwrapped)
            prepare_store_checkpoints(trainer)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._end_of_fit_state = None  # a new fit: the last one's state is stale (and freed before workers start)
        self._errors_dir = tempfile.mkdtemp(prefix="lightning_strategies_errors_")
        self.workers_failed = False
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except (ProcessRaisedException, ProcessExitedException) as error:
            self.workers_failed = True  # this process holds none of their state: saves here are refused
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
            trainer = args[0] if args else None
            if self._start_method == "fork" and isinstance(trainer, pl.Trainer):
                reopen_callback_filesystems(trainer)  # s3fs opened in the parent refuses to work in a fork
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

    def capture_end_of_fit(self, trainer: pl.Trainer) -> None:
        """Takes what the main process gets back; the strategy's teardown calls it on every rank of a worker.

        The results are sent after teardown, when the wrapper that could gather them is gone: take them now, while
        every rank still holds its shards. The end-of-fit checkpoint is dumped exactly as ``trainer.save_checkpoint``
        would dump it here (the ``on_save_checkpoint`` hooks run once more).

        Args:
            trainer: The Trainer whose fit ends.
        """
        if trainer.state.fn != TrainerFn.FITTING or not _distributed_is_initialized():
            return  # not fitting, or the launching process tearing down after a failure
        if self._hand_back == "checkpoint" and self._source.checkpoint_metadata().state_dict_type == "full":
            # The full dump (False: not weights-only), as trainer.save_checkpoint(path) makes it.
            checkpoint = dump_checkpoint(trainer, with_training_state=True)
            self._end_of_fit_weights = checkpoint.pop("state_dict")
            self._end_of_fit_state = checkpoint if self._launched_strategy.is_global_zero else None
        else:  # a sharded save would dump shards: hand back the canonical weights only
            self._end_of_fit_weights = self._source.full_model_state()
        # Leave together: a spawned rank that exits while its peer still finishes the gather's last collective
        # closes the peer's gloo connection under it, and the peer aborts (SIGABRT) on its way out.
        self._launched_strategy.barrier("end of fit captured")

    def complete_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """In the main process after a fit: ``checkpoint`` completed with the end-of-fit training state.

        Elsewhere (in a worker, or before any fit) ``checkpoint`` itself.
        """
        if self._end_of_fit_state is None or _distributed_is_initialized():
            return checkpoint
        return complete_with_end_of_fit_state(checkpoint, self._end_of_fit_state)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        weights, self._end_of_fit_weights = self._end_of_fit_weights, {}
        training_state, self._end_of_fit_state = self._end_of_fit_state, None
        if self._launched_strategy.local_rank != 0:
            return None
        weights_path = None
        extra = self.get_extra_results(trainer)
        if fitting and self._launched_strategy.is_global_zero:
            # A fresh directory per run: the filesystem may be shared between nodes.
            directory = tempfile.mkdtemp(prefix="lightning_strategies_hand_back_")
            # Written before the main process reads them (not in AsyncCheckpointIO's background thread).
            io = synchronous_checkpoint_io(self._launched_strategy.checkpoint_io)
            weights_path = os.path.join(directory, "weights.ckpt")
            io.save_checkpoint(weights, weights_path)
            if training_state is not None:
                extra[_TRAINING_STATE_PATH] = os.path.join(directory, "training_state.ckpt")
                io.save_checkpoint(training_state, extra[_TRAINING_STATE_PATH])
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        weights_path = worker_output.weights_path
        if weights_path is not None and module is not None:
            if has_meta_tensors(module):
                # Built on the meta device here (init_module(empty_init=True)): loading into a meta tensor is a silent
                # no-op, so the tensors get memory (and their reset_parameters() values, for buffers the weights lack).
                materialise_meta_tensors(module, torch.device("cpu"))
            # Upstream loads the weights with strict=False: a compiled submodule, whose keys here hold `_orig_mod`,
            # would silently keep its old weights. The canonical keys are renamed to the module's own first.
            weights = load_weights_only(self._launched_strategy.checkpoint_io.load_checkpoint, weights_path)
            module.load_state_dict(to_module_keys(weights, module), strict=False)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
        state_path = worker_output.extra.get(_TRAINING_STATE_PATH)
        if state_path is not None:
            io = self._launched_strategy.checkpoint_io
            self._end_of_fit_state = load_weights_only(io.load_checkpoint, state_path)
        if weights_path is not None:
            shutil.rmtree(os.path.dirname(weights_path), ignore_errors=True)

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state["_end_of_fit_state"] = None  # spawned workers of a later validate/test need no copy of it
        return state


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


class StoreAwareScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ranks started as processes of their own (``torchrun``, or the script run again), with
    ``ModelCheckpoint``'s checkpoints on stores prepared before the run (``store_saves.prepare_store_checkpoints``)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            prepare_store_checkpoints(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)
