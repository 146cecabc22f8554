"""The seam between :class:`~lightning_strategies.DirectReferenceStrategy` and a strategy's own sharded checkpoints.

A strategy that saves sharded (``state_dict_type="sharded"``) describes its format with one small
:class:`ShardedFormat`: what each rank writes, which directories it reads in place, how it checks and loads them. The
base class owns the flow around it, once for every strategy: the same path on every rank, the staging directory and
its atomic swap, the save id, ``meta.pt``, the metadata block, another format's directory read whole (consolidated),
validation on every rank and the ranks' agreement before any weight changes, the warning of a weights-only resume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from torch.optim import Optimizer

from lightning_strategies.checkpoint.errors import CheckpointError
from lightning_strategies.checkpoint.sharded import ShardedCheckpoint


class ShardedFormat(ABC):
    """A strategy's sharded checkpoint directory: its part in saving and restoring one.

    The strategy returns a new instance from
    :meth:`~lightning_strategies.DirectReferenceStrategy.sharded_format`; one instance serves one save, or one restore
    from :meth:`open` to :meth:`load_optimizers` (it may keep what it read in between). A write-only format
    implements the three save methods; one that reads its directories in place also implements the six restore
    methods.
    """

    #: ``write`` returns on rank 0 only once every rank's files are written (``torch.distributed.checkpoint.save``
    #: does: its last step gathers every rank's write results), so no barrier is needed before the swap.
    collective_write: ClassVar[bool] = False
    #: :meth:`background_writer` is implemented: asynchronous saves (``async_save=True``) write this format in a
    #: background thread; formats without it are written synchronously under that option.
    writes_in_background: ClassVar[bool] = False

    # ------------------------------------------------------------------ save

    @abstractmethod
    def model_state(self) -> dict[str, Any]:
        """This rank's part of the model state: what Lightning puts into ``checkpoint["state_dict"]``."""

    @abstractmethod
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's part of one optimizer's state: an entry of ``checkpoint["optimizer_states"]``."""

    @abstractmethod
    def write(self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str) -> None:
        """Writes this rank's files of ``checkpoint`` into ``staging``, stamped with ``save_id``; ``staging`` becomes
        the checkpoint ``directory`` once every rank's files are written.

        ``meta.pt`` (everything but the model and optimizer states) is written by the base class afterwards.
        """

    def background_writer(
        self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str, process_group: Any
    ) -> Callable[[], None]:
        """:meth:`write` split for an asynchronous save: reads now whatever it needs of the strategy and returns the
        file writes alone, which run in a background thread while training goes on.

        Args:
            checkpoint: A CPU copy of what Lightning dumped (training may change the live tensors meanwhile).
            directory: The checkpoint directory.
            staging: Where this rank's files go.
            save_id: The save id to stamp them with.
            process_group: For a :attr:`collective_write` format: the group the returned writer's collectives run on
                (training's collectives keep the default group meanwhile); else ``None``.

        Raises:
            NotImplementedError: The format does not set :attr:`writes_in_background`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not write in the background.")

    # ------------------------------------------------------------------ restore
    # A write-only format keeps these defaults: its directories are consolidated and loaded as full checkpoints
    # (they must be in one of the layouts consolidation reads: torch.distributed.checkpoint, or this package's rank
    # files). A format that reads in place returns True from reads_in_place and implements the other five.

    def reads_in_place(self, sharded: ShardedCheckpoint) -> bool:
        """Whether this format restores ``sharded`` itself; any other directory is consolidated and loaded as full.

        Default: ``False`` (a write-only format).
        """
        return False

    def _not_read_in_place(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__}.reads_in_place() returned True but {method}() is not implemented: implement it, or"
            " return False so that the directory is consolidated and loaded as a full checkpoint."
        )

    def open(self, sharded: ShardedCheckpoint) -> dict[str, Any]:
        """Reads what this rank needs of ``sharded``: the checkpoint dict Lightning restores from.

        It holds ``meta.pt``'s entries (loops, callbacks, schedulers) and an ``"optimizer_states"`` entry whenever the
        save wrote optimizer states (Lightning restores optimizers only when the key is there).
        """
        raise self._not_read_in_place("open")

    def holds_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether the opened save holds optimizer states (``False`` for a weights-only save)."""
        raise self._not_read_in_place("holds_optimizer_states")

    def problem(
        self, checkpoint: Mapping[str, Any], strict: bool, restoring_optimizers: bool
    ) -> CheckpointError | None:
        """Why this rank's part of the checkpoint does not fit this run, or ``None``: nothing is loaded here.

        Args:
            checkpoint: What :meth:`open` returned.
            strict: Whether the model's keys must match exactly.
            restoring_optimizers: Whether the optimizer states are restored too (a fit that restores them), so they
                are checked now, before any weight changes.
        """
        raise self._not_read_in_place("problem")

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Loads the checked model state into the (wrapped) model."""
        raise self._not_read_in_place("load_model")

    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the checked optimizer states into the strategy's optimizers (only when the save holds them)."""
        raise self._not_read_in_place("load_optimizers")
