"""Asynchronous saves (``async_save=True``): the step loop waits only for the part of a save that needs the ranks.

A save runs in two parts. In the foreground, on every rank: what needs the live state — this rank's part of it copied
to the CPU (the *staging copy*: for a full file what each rank sends to rank 0, and on rank 0 the full tensors, which
its own parts go straight into; for a sharded directory this rank's shards), so that the next optimizer step may
change the weights at once. In a background thread, at a lower CPU priority (:mod:`.background_priority`): for a full
file the gathers' transfers to rank 0 (held back by :class:`~.gather.DeferredTransfers`, run on a gloo group of their
own) and ``torch.save`` on rank 0; each rank's files of a sharded directory (``torch.distributed.checkpoint`` on that
gloo group).

The save is then *pending*. The ranks agree on its outcome (one all-gather) and, when every rank's write succeeded,
rank 0 commits it: a sharded directory gets ``meta.pt`` and is swapped into place only then; a full file is already in
place, renamed atomically by its own write. For a sharded save the background threads do this among themselves, on a
gloo group of their own, as soon as every rank's files are written; for a full file the main threads do it. Either way
the step loop learns the outcome when the ranks next meet — at the next save, at the end of training
(``on_train_end``) or in ``teardown`` — which wait for the pending save, and only then are the checkpoints
``ModelCheckpoint`` dropped meanwhile removed. When a write failed on any rank, every rank raises
:class:`AsyncSaveError` there and the previous checkpoint stays. A kill at any point leaves the previous checkpoint:
nothing of a save is visible at its path before its commit.
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_strategies.checkpoint.atomic import raise_if_disk_full, replace_directory
from lightning_strategies.checkpoint.metadata import METADATA_KEY
from lightning_strategies.checkpoint.paced_writes import Pacing, paced
from lightning_strategies.checkpoint.remote import open_store
from lightning_strategies.checkpoint.sharded import (
    SHARDED_STATE_KEYS,
    new_save_id,
    remove_stale_saves,
    staging_directory,
    write_sharded_meta,
)
from lightning_strategies.checkpoint.targets import SaveRefusal, is_url

from .._lightning import _PATH, _distributed_is_initialized, trainer_of
from . import background_priority
from .agreement import agree_on_sharded_save, require_same_save_path
from .gather import DeferredTransfers, deferring_transfers, is_fresh_copy
from .store_saves import background_upload, commit_uploaded

if TYPE_CHECKING:
    from .base import DirectReferenceStrategy
    from .sharded_format import ShardedFormat

log = logging.getLogger(__name__)


#: The share of the time between two saves within which a paced background write should be done (the rest is left
#: for a write that got less idle CPU than the one before, so that the next save still finds it done).
WRITE_SHARE_OF_INTERVAL = 0.5


class AsyncSaveError(RuntimeError):
    """The background write of an asynchronous save failed on some rank; raised on every rank.

    Nothing of that save is at its path: the path holds the previous checkpoint, and the checkpoints
    ``ModelCheckpoint`` meant to remove after it are kept.
    """


def write_in_background(write: Callable[[], None]) -> None:
    """Runs one rank's file writes of a save, in the background thread (a seam: tests slow it down or fail it)."""
    write()


def staged_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU and every container rebuilt: what a background write may read
    while training goes on (the live tensors change at the next step). Other values are shared (plain values), and so
    are CPU tensors a gather of this save allocated (:func:`~.gather.is_fresh_copy`: views of them too), which nothing
    else holds or changes: a second copy would only double the checkpoint in memory and block the step longer."""
    if isinstance(value, DTensor):  # a DTensor whose local shard is a CPU copy
        if value.device.type != "cpu":
            return value.detach().to("cpu")
        return DTensor.from_local(
            value.to_local().detach().clone(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, Tensor):
        if is_fresh_copy(value):
            return value.detach()  # the same storage
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        rebuilt = copy.copy(value)  # keeps the mapping's type (OrderedDict, Lightning's AttributeDict, ...)
        for key, item in value.items():
            rebuilt[key] = staged_copy(item)
        return rebuilt
    if isinstance(value, Mapping):
        return {key: staged_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [staged_copy(item) for item in value]
    if isinstance(value, tuple):
        items = [staged_copy(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def staged_bytes(value: Any, *, shared_too: bool = False) -> int:
    """Bytes of the tensors a staging copy copied (a DTensor counts its local shard; a shared fresh copy nothing,
    unless ``shared_too``: then the bytes of all its tensors, what its write writes)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        return local.numel() * local.element_size()
    if isinstance(value, Tensor):
        return 0 if is_fresh_copy(value) and not shared_too else value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(staged_bytes(item, shared_too=shared_too) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(staged_bytes(item, shared_too=shared_too) for item in value)
    return 0


def _everyone(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` in rank order (a collective on ``group``, the default group when ``None``); alone:
    ``[value]``."""
    if not _distributed_is_initialized() or torch.distributed.get_world_size() < 2:
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value, group=group)
    return gathered


def _described(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


@dataclass
class _Save:
    """A save whose writes were started; on rank 0 what commits or discards it."""

    target: str
    sharded: bool
    write: Callable[[], None] | None  # dropped once run: the staging copy it holds is freed then
    #: A full save's gathers' transfers, run by the background threads before the write (on :attr:`transfer_group`).
    transfers: DeferredTransfers | None = None
    transfer_group: Any = None
    thread: threading.Thread | None = None
    native_id: int | None = None  # the background thread's, while its priority is lowered
    pacing: Pacing = field(default_factory=lambda: Pacing(0.0, 0))  # pauses between its files' slices (paced_writes)
    cpu_s: float = 0.0  # CPU seconds the background thread used (its transfers, writes, agreement and commit)
    errors: list[BaseException] = field(default_factory=list)
    commit: Callable[[], None] | None = None
    discard: Callable[[], None] | None = None
    #: The group the background threads agree and commit on (sharded saves); ``None``: the main thread does it.
    group: Any = None
    agreed: bool = False
    failed: list[tuple[int, str]] = field(default_factory=list)  # (rank, error) of each rank whose write failed
    commit_failure: str | None = None  # rank 0's commit error, as every rank learnt it
    commit_error: BaseException | None = None  # the same on rank 0

    def agree(self) -> None:
        """The ranks agree on the writes' outcome (a collective on :attr:`group`); when every write succeeded rank 0
        commits the save, and every rank learns whether it did. Sets :attr:`failed` and :attr:`commit_failure`."""
        error = self.errors[0] if self.errors else None
        everyone = _everyone(None if error is None else _described(error), self.group)
        self.failed = [(rank, text) for rank, text in enumerate(everyone) if text is not None]
        if self.failed:
            if self.discard is not None:
                self.discard()
            if self.sharded:  # the ranks leave together: one that raised at once and ended would have its launcher
                # stop the others (SIGTERM) while rank 0 still removed the staging directory, before they raised too.
                _everyone(None, self.group)
        elif self.sharded:
            committed: str | None = None
            if self.commit is not None:
                try:
                    self.commit()
                except BaseException as caught:
                    if self.discard is not None:
                        self.discard()
                    self.commit_error, committed = caught, _described(caught)
            self.commit_failure = _everyone(committed, self.group)[0]
        self.agreed = True


class AsyncSaves:
    """The asynchronous saves of one strategy: at most one pending save, its background thread, its commit, the
    removals that wait for it, and the error of its writes (raised on every rank when the ranks next meet).

    Args:
        strategy: The strategy whose saves these are.
    """

    def __init__(self, strategy: DirectReferenceStrategy) -> None:
        self._strategy = strategy
        self._pending: _Save | None = None
        self._removals: list[Callable[[], None]] = []
        self._group: Any = None  # the gloo group background DCP writes and full saves' transfers run on
        self._group_threads: list[int] = []  # the native ids of its gloo threads, lowered like the writers'
        self._transfers = DeferredTransfers()  # the transfers the state being taken for a full save held back
        self._open = False  # between on_train_start and on_train_end: saves run asynchronously
        self._last_started: float | None = None  # when the save before this fit's next one started (perf_counter)
        #: Bytes of tensors this rank copied for its last asynchronous save (its staging copy).
        self.last_staged_bytes = 0
        #: Seconds the last save waited for the save before it (its writes, the agreement, the commit, removals).
        self.last_wait_s = 0.0
        #: Seconds the last asynchronous save took to start (agreement on the path, staging copy, thread start).
        self.last_start_s = 0.0
        #: CPU seconds the background thread of the last finished save used on this rank (what it took from training).
        self.last_write_cpu_s = 0.0

    @property
    def pending(self) -> bool:
        """Whether a save was started whose outcome the ranks have not agreed on yet."""
        return self._pending is not None

    @property
    def writing(self) -> bool:
        """Whether the pending save's background thread still runs on this rank: its writes and, for a sharded save,
        the agreement and the commit (what runs alongside the step loop; ``pending`` stays true until the ranks next
        meet)."""
        save = self._pending
        return save is not None and save.thread is not None and save.thread.is_alive()

    # ------------------------------------------------------------------ saving

    def open(self) -> None:
        """Saves from now on run asynchronously (the start of training: ``on_train_start``, on every rank).

        The background threads get their gloo group here, where every rank is anyway, rather than in the first save
        (creating a group takes a collective and a few hundred milliseconds on a busy machine): for sharded saves they
        agree on a save's outcome and commit it on that group (and DCP's writes run their collectives there); for full
        files they run there the transfers of the gathers to rank 0 (:meth:`holding_transfers`).
        """
        self._open = True
        self._last_started = None
        strategy = self._strategy
        if not _distributed_is_initialized() or torch.distributed.get_world_size() < 2:
            return
        if strategy._saves_sharded:
            sharded = strategy.sharded_format()
            if sharded is not None and sharded.writes_in_background:
                self._background_group()
        elif strategy.root_device.type == "cpu":  # gloo carries the held-back transfers of CPU tensors only
            self._background_group()

    def _applies(self) -> bool:
        """Whether this save runs asynchronously: only between ``on_train_start`` and ``on_train_end``, where a later
        point (the next save, ``on_train_end``, ``teardown``) is sure to commit it, and not in a run that is being
        interrupted. Elsewhere (after training, in the launching process of a fork/spawn run) saves are synchronous."""
        module = self._strategy.lightning_module
        trainer = trainer_of(module) if module is not None else None
        return self._open and _distributed_is_initialized() and trainer is not None and not trainer.interrupted

    def drop_held_transfers(self) -> None:
        """Forgets transfers held back for a save that never came (a save's state taken, then not saved): the start
        of a save's state (``lightning_module_state_dict``), on every rank. Nothing was sent yet, so every rank drops
        its own."""
        if len(self._transfers):
            log.warning("A full save's state was taken but not saved; its held-back gathers are dropped.")
        self._transfers.drop()

    @contextmanager
    def holding_transfers(self) -> Iterator[None]:
        """Around the taking of a full save's canonical state (``lightning_module_state_dict``, ``optimizer_state``):
        when the save will run in the background, the gathers to rank 0 inside only copy what each rank sends to the
        CPU and hold the transfers back for the background thread (:class:`~.gather.DeferredTransfers`), which runs
        them on its own gloo group before rank 0 writes the file. Rank 0's gathered tensors are complete only then:
        the state is meant for the save that follows."""
        if self._strategy._saves_sharded or self._group is None or not self._applies():
            yield
            return
        with deferring_transfers(self._transfers):
            yield

    def save(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> bool:
        """Finishes the pending save, then starts this one in the background when it may be.

        Returns:
            Whether this save was started here; ``False``: the strategy saves synchronously.

        Raises:
            AsyncSaveError: The pending save failed (on every rank).
        """
        started = time.perf_counter()
        self.finish()
        self.last_wait_s = time.perf_counter() - started
        if not self._applies():
            self._run_held_transfers()  # the state's gathers complete here, before the synchronous write
            return False
        started = time.perf_counter()
        try:
            return self._start_save(checkpoint, filepath, storage_options)
        finally:
            self.last_start_s = time.perf_counter() - started
            self._last_started = started

    def _pacing(self, written: Any) -> Pacing:
        """The pace of this rank's write of ``written`` (paced_writes): done within :data:`WRITE_SHARE_OF_INTERVAL`
        of the time since the save before started, so that the next save, as far apart, finds it done; the first save
        of a fit, which knows no interval, is not paced."""
        if self._last_started is None:
            return Pacing(0.0, 0)
        budget = (time.perf_counter() - self._last_started) * WRITE_SHARE_OF_INTERVAL
        return Pacing(budget, staged_bytes(written, shared_too=True))

    def _start_save(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None) -> bool:
        strategy = self._strategy
        if strategy._saves_sharded:
            sharded = strategy._require_sharded_format()
            if not sharded.writes_in_background:  # the format cannot split its write: written synchronously
                self._run_held_transfers()
                return False
            refusal = strategy.save_refusal(filepath, storage_options)  # of the path as given: Path() folds "//"
            if is_url(filepath):
                return self._start_store_save(sharded, checkpoint, str(filepath), storage_options, refusal)
            directory = Path(filepath)
            save_id = agree_on_sharded_save(directory, new_save_id(), refusal)
            staging = staging_directory(directory, save_id)
            group = self._background_group() if sharded.collective_write else None  # the writes' collectives
            staged = staged_copy(checkpoint)
            writer = sharded.background_writer(staged, directory, staging, save_id, group)
            self.last_staged_bytes = staged_bytes(staged)
            if strategy.is_global_zero:
                remove_stale_saves(directory, keep=staging)
            staging.mkdir(parents=True, exist_ok=True)
            metadata = strategy.checkpoint_metadata()
            rest = {key: value for key, value in staged.items() if key not in SHARDED_STATE_KEYS}  # meta.pt's part

            def commit() -> None:
                write_sharded_meta(strategy.sharded_checkpoint_io, rest, metadata, staging, save_id)
                replace_directory(staging, directory, save_id)

            self._start_in_background(
                str(directory),
                writer,
                pacing=self._pacing(staged),
                sharded=True,
                commit=commit if strategy.is_global_zero else None,
                discard=partial(shutil.rmtree, staging, ignore_errors=True) if strategy.is_global_zero else None,
                group=self._background_group(),  # every rank writes: their threads agree and commit on their own
            )
            return True
        # A rank's different path would be silently ignored; a path rank 0 must not replace is refused on every rank.
        require_same_save_path(filepath, strategy.save_refusal(filepath, storage_options))
        transfers, self._transfers = self._transfers, DeferredTransfers()
        full_writer: Callable[[], None] | None = None
        written: dict[str, Any] | None = None  # rank 0's file
        self.last_staged_bytes = transfers.staged_bytes
        if strategy.is_global_zero:
            written = staged_copy({**checkpoint, METADATA_KEY: strategy.checkpoint_metadata().to_dict()})
            self.last_staged_bytes += staged_bytes(written)
            io = strategy.sharded_checkpoint_io  # written in this thread: no AsyncCheckpointIO on top
            full_writer = partial(io.save_checkpoint, written, filepath, storage_options=storage_options)
        # Every rank's thread sends (or receives) its part of the gathers first, then rank 0's thread writes the file.
        self._start_in_background(
            str(filepath),
            full_writer,
            pacing=self._pacing(written),
            sharded=False,
            transfers=transfers if len(transfers) else None,
        )
        return True

    def _start_store_save(
        self,
        sharded: ShardedFormat,
        checkpoint: dict[str, Any],
        url: str,
        storage_options: Any | None,
        refusal: SaveRefusal | None,
    ) -> bool:
        """A sharded save to a store in the background: each rank's thread writes its shards into a local scratch
        directory and uploads them under the save's prefix; once every rank's upload succeeded, rank 0's thread
        uploads ``meta.pt`` and writes the commit marker (``store_saves``). A failure leaves it uncommitted."""
        strategy = self._strategy
        store = open_store(url, storage_options)
        save_id = agree_on_sharded_save(url, new_save_id(), refusal)
        scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-upload-"))
        group = self._background_group() if sharded.collective_write else None  # the writes' collectives
        staged = staged_copy(checkpoint)
        writes = sharded.background_writer(staged, scratch, scratch, save_id, group)  # local, then uploaded
        self.last_staged_bytes = staged_bytes(staged)
        rest = {key: value for key, value in staged.items() if key not in SHARDED_STATE_KEYS}  # meta.pt's part
        commit = partial(
            commit_uploaded,
            store,
            save_id,
            rest,
            strategy.checkpoint_metadata(),
            strategy.sharded_checkpoint_io,
            strategy.stored_saves_to_keep(url),
        )
        self._start_in_background(
            url,
            background_upload(writes, store, save_id, scratch),
            pacing=self._pacing(staged),
            sharded=True,
            commit=commit if strategy.is_global_zero else None,
            group=self._background_group(),  # every rank uploads: their threads agree and commit on their own
        )
        return True

    def _run_held_transfers(self) -> None:
        """Runs the transfers held back for this save in the foreground (a save that turned out synchronous)."""
        transfers, self._transfers = self._transfers, DeferredTransfers()
        if len(transfers):
            with self._group_at_full_priority():
                transfers.run(self._group)

    def _start_in_background(
        self,
        target: str,
        write: Callable[[], None] | None,
        *,
        pacing: Pacing,
        sharded: bool,
        commit: Callable[[], None] | None = None,
        discard: Callable[[], None] | None = None,
        group: Any = None,
        transfers: DeferredTransfers | None = None,
    ) -> None:
        save = _Save(
            target, sharded, write, transfers, self._group, pacing=pacing, commit=commit, discard=discard, group=group
        )
        if write is not None or transfers is not None:

            def run() -> None:
                cpu_started = time.thread_time()
                save.native_id = background_priority.lower_this_thread()  # the ranks' steps keep their cores
                with background_priority.quick_gil_handoffs(), paced(save.pacing):
                    self._run_in_background(save, target)
                save.cpu_s = time.thread_time() - cpu_started

            # A daemon: a run that failed does not wait at exit for a write nobody will commit.
            save.thread = threading.Thread(target=run, name=f"lightning_strategies async save {target}", daemon=True)
            save.thread.start()
        self._pending = save

    @staticmethod
    def _run_in_background(save: _Save, target: str) -> None:
        """The background thread's work: the held-back transfers, this rank's writes and, for a sharded save, the
        agreement and the commit."""
        writes, save.write = save.write, None
        try:
            try:
                if save.transfers is not None:  # outside the seam: a failed write never strands a peer
                    save.transfers.run(save.transfer_group)
                if writes is not None:
                    write_in_background(writes)
            except BaseException as error:
                raise_if_disk_full(error, Path(target))
                raise
        except BaseException as error:  # kept for the ranks' agreement: raised on every rank there
            save.errors.append(error)
        finally:
            del writes
        if save.group is not None:  # the writes' threads meet on their own group; the step loop goes on
            try:
                save.agree()
            except BaseException as error:  # the agreement itself failed (a peer gone): the save is lost
                save.failed = [(-1, _described(error))]
                save.agreed = True

    def _background_group(self) -> Any:
        """A gloo group of the same ranks for the background writes' collectives (created once, by every rank: a
        collective); training's collectives stay alone on the default group."""
        if self._group is None:
            # gloo moves the bytes of the group's transfers on threads the group starts: they work for the background
            # writes, so they run at the writes' low priority (background_priority).
            self._group, started = background_priority.threads_started_by(
                lambda: torch.distributed.new_group(backend="gloo")
            )
            self._group_threads = background_priority.lower(started)
        return self._group

    @contextmanager
    def _group_at_full_priority(self) -> Iterator[None]:
        """The background group's gloo threads at the training thread's priority, while the step loop waits for them."""
        background_priority.restore(self._group_threads)
        try:
            yield
        finally:
            background_priority.lower(self._group_threads)

    # ------------------------------------------------------------------ the ranks meet

    def defer_removal(self, remove: Callable[[], None]) -> bool:
        """Keeps ``remove`` (a checkpoint ``ModelCheckpoint`` no longer keeps) until the pending save is committed.

        Returns:
            Whether it was kept; ``False``: nothing is pending, remove it now.
        """
        if self._pending is None:
            return False
        self._removals.append(remove)
        return True

    def finish(self) -> None:
        """Waits for the pending save's writes, agrees on their outcome and commits it (a collective: every rank calls
        it, at the same point); then the removals that waited for it run. Nothing pending: returns at once.

        Raises:
            AsyncSaveError: A background write failed on some rank (on every rank; the previous checkpoint stays), or
                rank 0's commit failed.
        """
        save, self._pending = self._pending, None
        if save is None:
            return
        with self._group_at_full_priority():  # the step loop waits for the save now: no core to leave
            if save.thread is not None:
                save.pacing.hurry()
                background_priority.restore(save.native_id)
                save.thread.join()
                self.last_write_cpu_s = save.cpu_s
            if not save.agreed:  # a full file: the ranks agree here
                save.agree()
        error = save.errors[0] if save.errors else None
        if save.failed:
            self._removals.clear()  # the older checkpoints stay: the new one did not appear
            ranks = ", ".join(str(rank) for rank, _ in save.failed)
            raise AsyncSaveError(
                f"The asynchronous save of {save.target!r} failed on rank {ranks} ({save.failed[0][1]}); its path holds"
                " the previous checkpoint, and no older checkpoint was removed. Fix the cause (space, permissions, the"
                " store) and resume from the last complete checkpoint."
            ) from error
        if save.commit_failure is not None:
            self._removals.clear()
            raise AsyncSaveError(
                f"The asynchronous save of {save.target!r} failed when rank 0 completed it ({save.commit_failure}); its"
                " path holds the previous checkpoint, and no older checkpoint was removed."
            ) from save.commit_error
        removals, self._removals = self._removals, []
        for remove in removals:
            remove()

    def abandon(self, timeout: float) -> None:
        """After a failure (no collective may run): waits up to ``timeout`` seconds for the pending write and drops
        it uncommitted. Its staging directory or temporary file stays hidden; the next save of its path removes it."""
        save, self._pending = self._pending, None
        self._removals.clear()
        if save is not None and save.thread is not None:
            save.pacing.hurry()
            background_priority.restore(save.native_id)
            save.thread.join(timeout)
            if save.thread.is_alive():
                log.warning("The background write of %r is still running; it is left uncommitted.", save.target)

    def end_of_training(self) -> None:
        """``on_train_end``: commits the pending save; later saves of the run are synchronous.

        Raises:
            AsyncSaveError: As :meth:`finish`.
        """
        self._open = False
        self.finish()

    def close(self, failed: bool, timeout: float) -> None:
        """At ``teardown``: commits the pending save (or, after a failure, abandons it) and drops the background group.

        Raises:
            AsyncSaveError: As :meth:`finish`.
        """
        self._open = False
        try:
            if failed:
                self.abandon(timeout)
            else:
                self.finish()
        finally:
            group, self._group, self._group_threads = self._group, None, []
            if group is not None and not failed and _distributed_is_initialized():
                torch.distributed.destroy_process_group(group)
