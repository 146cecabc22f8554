"""The checkpoint flow every strategy of this package shares: state out, sharded saves, state in.

:class:`CheckpointFlow` owns what Lightning asks a strategy for when it saves and restores, once for every strategy:
canonical model and optimizer state (``lightning_module_state_dict``, ``optimizer_state``) with the ``_canonical_*``
hooks a strategy overrides where its wrapper shards state; ``save_checkpoint`` (a full file on rank 0, or a sharded
directory staged and swapped in atomically, :meth:`CheckpointFlow.save_sharded`); ``load_checkpoint`` (a full file, a
directory this strategy reads in place through its :class:`~.sharded_format.ShardedFormat`, or another format's
directory consolidated); and ``load_model_state_dict``/``load_optimizer_state_dict``, which validate every part before
any weight changes, with the ``_load_canonical_*`` hooks. Strategies override the hooks, never the flow.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import (
    FORMAT_VERSION,
    METADATA_KEY,
    CheckpointMetadata,
    canonical_keys,
    check_optimizer_states,
    load_model_state,
    param_group_shapes,
    require_full_checkpoint,
    to_cpu_state,
)
from lightning_strategies.checkpoint.atomic import raise_if_disk_full, replace_directory
from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.errors import CheckpointFormatError
from lightning_strategies.checkpoint.io import copy_out_of_mapping, reading_from
from lightning_strategies.checkpoint.optimizer_state import numbered_through_groups
from lightning_strategies.checkpoint.remote import CommittedSave, files_of, open_store, remove_checkpoint_at
from lightning_strategies.checkpoint.sharded import (
    ShardedCheckpoint,
    new_save_id,
    open_sharded,
    remove_stale_saves,
    sharded_directory,
    staging_directory,
    write_sharded_meta,
)
from lightning_strategies.checkpoint.targets import (
    SaveRefusal,
    is_url,
    removal_problem,
    replace_problem,
    same_checkpoint_path,
)
from lightning_strategies.checkpoint.training_state import holds_optimizer_state, resume_without_optimizer_state

from .._lightning import (
    _PATH,
    CheckpointIO,
    ParallelStrategy,
    TrainerFn,
    _optimizer_to_device,
    pl,
    raw_optimizer,
    trainer_of,
)
from .agreement import agree_on_sharded_save, refuse_unless_every_rank_fits, require_same_save_path
from .atomic_io import finish_background_writes, loads_mapped, read_full_checkpoint, synchronous_checkpoint_io
from .gather import forget_fresh_copies
from .launcher import CanonicalStateLauncher
from .sharded_format import ShardedFormat
from .store_saves import Downloads, resolve_on_store, save_sharded_to_store, split_marker_url, store_refusal

if TYPE_CHECKING:
    from .async_saves import AsyncSaves

StateDictType = Literal["full", "sharded"]


class CheckpointFlow(ParallelStrategy):
    """The save and restore flow of :class:`~lightning_strategies.DirectReferenceStrategy`, which inherits it.

    Not a strategy of its own: it relies on the attributes and methods declared below, which the strategy provides.
    """

    #: ``"full"`` (one canonical file) or ``"sharded"`` (a directory in the format :meth:`sharded_format` describes);
    #: strategies that save sharded take it as an option (see :meth:`_checked_state_dict_type`).
    _state_dict_type: StateDictType = "full"

    if TYPE_CHECKING:  # provided by the strategy: DirectReferenceStrategy and its FailureHandling
        strategy_name: ClassVar[str]
        _checkpoint_source: str  # names what is being restored, in every error message
        _sharded_reader: ShardedFormat | None  # the format restoring the directory being loaded
        _async_saves: AsyncSaves  # saves written in the background (async_save=True)
        _store_downloads: Downloads  # local copies of the stored sharded saves a restore reads
        _resumed_store_save: tuple[str, str] | None  # (URL, save id) of the stored sharded save the run resumed from

        def require_lightning_module(self) -> pl.LightningModule: ...

        def require_save_possible(self) -> None: ...

    # ------------------------------------------------------------------ state out: canonical, rank 0 only

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model state a checkpoint holds: by default :meth:`full_model_state`.

        Between ``on_train_start`` and ``on_train_end`` with ``async_save=True``, a full save's gathers hold their
        transfers back for the save's background thread (``AsyncSaves.holding_transfers``): rank 0's tensors receive the
        other ranks' parts only once the save that follows runs them. :meth:`full_model_state` always gathers at once.
        """
        self.require_save_possible()  # the first thing a save asks for: before any of its collectives
        forget_fresh_copies()  # a save starts: only its own gathers' copies may be shared with its background write
        self._async_saves.drop_held_transfers()
        if self._saves_sharded:  # every rank keeps its own part: no gather
            return self._require_sharded_format().model_state()
        with self._async_saves.holding_transfers():  # an asynchronous save gathers in its background thread
            return self.full_model_state()

    def full_model_state(self) -> dict[str, Any]:
        """Canonical model state on global rank 0 (the unwrapped module's keys, full CPU tensors); ``{}`` elsewhere.

        Every rank must call it: subclasses may gather with collectives. Submodules compiled with ``torch.compile``
        add no ``_orig_mod`` segment: the keys are the uncompiled module's (see ``checkpoint.canonical_keys``).
        """
        state = self._canonical_model_state()
        return canonical_keys(state) if self.is_global_zero else {}

    def _canonical_model_state(self) -> dict[str, Any]:
        """Hook: the canonical model state on rank 0. Default: the module holds whole tensors, read them directly."""
        if not self.is_global_zero:
            return {}
        return to_cpu_state(self.require_lightning_module().state_dict())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Canonical optimizer state (torch's integer-keyed layout over the whole model) on rank 0; ``{}`` elsewhere.

        Every rank must call it: sharded optimizers gather with collectives. With ``async_save=True`` during training
        the gathers' transfers wait for the save that follows, as in :meth:`lightning_module_state_dict`.
        """
        raw = raw_optimizer(optimizer)
        if self._saves_sharded:
            return self._require_sharded_format().optimizer_state(raw)
        with self._async_saves.holding_transfers():  # an asynchronous save gathers in its background thread
            state = self._canonical_optimizer_state(raw)
        return state if self.is_global_zero else {}

    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Hook: canonical state of one optimizer on rank 0. Default: a plain optimizer is already canonical."""
        return optimizer.state_dict() if self.is_global_zero else {}

    def checkpoint_metadata(self) -> CheckpointMetadata:
        """The ``checkpoint["lightning_strategies"]`` block this strategy writes."""
        return CheckpointMetadata(
            format_version=FORMAT_VERSION,
            strategy=self.strategy_name,
            world_size=self.world_size,
            state_dict_type=self._state_dict_type,
        )

    # ------------------------------------------------------------------ the sharded format

    def sharded_format(self) -> ShardedFormat | None:
        """Hook: a new :class:`ShardedFormat` describing this strategy's sharded directories; ``None`` (the default)
        when it writes none. Directories it does not read in place (and every directory, with ``None``) are
        consolidated and loaded as full checkpoints."""
        return None

    @staticmethod
    def _checked_state_dict_type(state_dict_type: str) -> StateDictType:
        """``state_dict_type`` as given to a strategy's constructor, checked.

        Raises:
            ValueError: Neither ``"full"`` nor ``"sharded"``.
        """
        if state_dict_type == "full":
            return "full"
        if state_dict_type == "sharded":
            return "sharded"
        raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")

    @property
    def _saves_sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def _require_sharded_format(self) -> ShardedFormat:
        sharded = self.sharded_format()
        if sharded is None:
            raise NotImplementedError(
                f"{type(self).__name__} has state_dict_type='sharded' but describes no sharded format: implement"
                " sharded_format(), or save with state_dict_type='full'."
            )
        return sharded

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        try:
            self._write_checkpoint(checkpoint, filepath, storage_options)
        finally:
            forget_fresh_copies()  # the save's gathered tensors are the checkpoint's now, none counts for the next

    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None) -> None:
        if self._async_saves.save(checkpoint, filepath, storage_options):
            return  # its files are written in the background; committed when the ranks next meet
        if self._saves_sharded:
            sharded = self._require_sharded_format()
            refusal = self.save_refusal(filepath, storage_options)  # of the path as given: Path() folds a URL's "//"
            if is_url(filepath):
                # Shards go into a local scratch directory (the one the format's messages name), then are uploaded.
                def write_locally(scratch: Path, save_id: str) -> None:
                    sharded.write(checkpoint, scratch, scratch, save_id)

                keep = self.stored_saves_to_keep(str(filepath))
                save_sharded_to_store(
                    self,
                    checkpoint,
                    str(filepath),
                    write_locally,
                    storage_options=storage_options,
                    refusal=refusal,
                    keep=keep,
                )
                return
            directory = Path(filepath)
            write = partial(sharded.write, checkpoint, directory)
            self.save_sharded(checkpoint, directory, write, collective_write=sharded.collective_write, refusal=refusal)
            return
        # A rank's different path would be silently ignored; a path rank 0 must not replace is refused on every rank.
        require_same_save_path(filepath, self.save_refusal(filepath, storage_options))
        if isinstance(self.launcher, CanonicalStateLauncher):  # the main process after a fork/spawn fit
            checkpoint = self.launcher.complete_checkpoint(checkpoint)
        if self.is_global_zero:
            stamped = {**checkpoint, METADATA_KEY: self.checkpoint_metadata().to_dict()}
            self.checkpoint_io.save_checkpoint(stamped, filepath, storage_options=storage_options)

    def save_refusal(self, filepath: _PATH, storage_options: Any | None = None) -> SaveRefusal | None:
        """On global rank 0: why this strategy's next save must not write to ``filepath``: it holds a file or directory
        that is not a checkpoint (see :mod:`~lightning_strategies.checkpoint.targets`), or it is a URL whose store
        cannot be reached or that holds objects no save wrote (:func:`.store_saves.store_refusal`); ``None`` when it
        may, and on every other rank. The save's agreement on its path raises it on every rank, before any write."""
        if not self.is_global_zero:
            return None
        if is_url(filepath):
            return store_refusal(str(filepath), storage_options, self._saves_sharded)
        problem = replace_problem(filepath, "sharded" if self._saves_sharded else "full")
        return None if problem is None else ("foreign path", problem)

    def stored_saves_to_keep(self, url: str) -> set[str]:
        """The save ids a save to the store ``url`` must not remove: the stored save this run resumed from."""
        resumed = self._resumed_store_save
        return {resumed[1]} if resumed is not None and same_checkpoint_path(resumed[0], url) else set()

    @property
    def sharded_checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO that writes the files of a sharded directory: ``checkpoint_io`` without
        ``AsyncCheckpointIO`` (the directory is swapped in right after the writes, so they must be done then)."""
        return synchronous_checkpoint_io(self.checkpoint_io)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Removes a checkpoint (``ModelCheckpoint`` removes the ones it no longer keeps) on global rank 0.

        A checkpoint that is not there yet may still be written by ``AsyncCheckpointIO`` in the background (saves
        are atomic: the path appears when its write is done); the removal waits for that write, which would
        otherwise put it there afterwards. While an asynchronous save (``async_save=True``) is pending, the removal
        waits until that save is committed: an old checkpoint goes only once the new one is complete.
        """
        if self._async_saves.defer_removal(partial(self.remove_checkpoint, filepath)):
            return  # removed once the pending asynchronous save is complete
        refusal = self._removal_refusal(filepath) if self.is_global_zero else None
        if refusal is not None:
            rank_zero_warn(refusal)
            return
        if self.is_global_zero and ("://" in str(filepath) or not os.path.lexists(filepath)):
            finish_background_writes(self.checkpoint_io)
        if self.is_global_zero and is_url(filepath):
            # A stored checkpoint's own objects only (a sharded one: each save's marker before its files).
            kept = remove_checkpoint_at(open_store(str(filepath)))
            if kept:
                rank_zero_warn(f"Removed the checkpoint {str(filepath)!r} but kept objects no save wrote: {kept[:3]}.")
            return
        super().remove_checkpoint(filepath)

    def _removal_refusal(self, filepath: _PATH) -> str | None:
        """Why ``filepath`` is kept although ``ModelCheckpoint`` no longer keeps it: it is the checkpoint this run
        resumed from (upstream issue 21813: a remote one was removed), or it holds files no checkpoint writes."""
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        resumed_from = getattr(trainer, "ckpt_path", None) if trainer is not None else None
        if resumed_from is not None and same_checkpoint_path(filepath, split_marker_url(str(resumed_from))[0]):
            return (
                f"Not removing {str(filepath)!r}: the run resumed from it, and it stays until you remove it (a later"
                " failure may need to resume from it again)."
            )
        return None if "://" in str(filepath) else removal_problem(filepath)

    def save_sharded(
        self,
        checkpoint: dict[str, Any],
        directory: Path,
        write_shards: Callable[[Path, str], None],
        *,
        collective_write: bool = False,
        refusal: SaveRefusal | None = None,
    ) -> None:
        """Writes a sharded checkpoint directory atomically: the previous save stays until this one is whole.

        The ranks check that they save to the same directory and take rank 0's save id (one all-gather); every rank
        writes its shards (stamped with the id and its rank) into a sibling staging directory; rank 0 adds
        ``meta.pt`` and swaps the staging directory in (an atomic exchange on Linux). A failure or a kill at any
        point leaves the previous complete checkpoint at ``directory``; a full disk is reported as
        :class:`~lightning_strategies.checkpoint.atomic.DiskFullError`.

        Args:
            checkpoint: What Lightning dumped; its state entries are the ranks' shards.
            directory: The checkpoint directory.
            write_shards: Writes this rank's shards into the staging directory it is given, stamped with the save id
                it is given (a collective for some formats).
            collective_write: ``write_shards`` returns on rank 0 only once every rank's shards are written
                (``torch.distributed.checkpoint.save`` does: its last step gathers every rank's write results), so
                rank 0 needs no barrier before it swaps the directory in.
            refusal: Rank 0's refusal of the path as the caller was given it (:meth:`save_refusal`); by default the
                refusal of ``directory``.

        Raises:
            BaseException: A write failed, or (with ``AsyncCheckpointIO``) an earlier background write had failed.
        """
        # Shards in different directories: none of them complete.
        refusal = self.save_refusal(directory) if refusal is None else refusal
        save_id = agree_on_sharded_save(directory, new_save_id(), refusal)
        staging = staging_directory(directory, save_id)
        if self.is_global_zero:
            remove_stale_saves(directory, keep=staging)
        staging.mkdir(parents=True, exist_ok=True)  # by every rank: none waits for another before writing
        try:
            write_shards(staging, save_id)
            # With AsyncCheckpointIO: an earlier background write's error is raised by this save (as the plugin's own
            # next save would raise it), and the writes of a plugin below another wrapper are done before the swap.
            finish_background_writes(self.checkpoint_io)
            if not collective_write:
                self.barrier("sharded checkpoint shards written")
            if self.is_global_zero:
                meta_io = self.sharded_checkpoint_io
                write_sharded_meta(meta_io, checkpoint, self.checkpoint_metadata(), staging, save_id)
                finish_background_writes(meta_io)
                replace_directory(staging, directory, save_id)
        except BaseException as error:
            if self.is_global_zero:
                shutil.rmtree(staging, ignore_errors=True)
            raise_if_disk_full(error, directory)
            raise
        self.barrier("sharded checkpoint complete")

    # ------------------------------------------------------------------ state in: validated, then loaded

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore into the wrapped model, after the optimizers exist: a checkpoint whose optimizer states do not fit
        # is then refused before the model's weights are touched.
        return True

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._sharded_reader = None
        self._store_downloads.clear()
        directory, source, full_path = sharded_directory(checkpoint_path), None, checkpoint_path
        on_store = resolve_on_store(str(checkpoint_path)) if is_url(checkpoint_path) else None
        if on_store is not None:  # every rank reads its host's local copy, which the host's ranks download together
            store, found = on_store
            if isinstance(found, CommittedSave):
                files = files_of(store, found)
                directory = self._store_downloads.fetch(store, files, Path(store.path).name or "checkpoint")
                source = f"Sharded checkpoint {store.url!r} (save {found.save_id})"
                self._resumed_store_save = (store.url, found.save_id)
            elif loads_mapped(self.checkpoint_io):  # else the user's plugin reads the URL as it will
                full_path = self._store_downloads.fetch(store, [found], "full") / found.name
        if directory is not None:
            sharded = open_sharded(directory, source=source)
            reader = self.sharded_format()
            if reader is None or not reader.reads_in_place(sharded):
                return self._load_consolidated(sharded)
            self._checkpoint_source = sharded.source
            opened = reader.open(sharded)
            self._sharded_reader = reader
            return opened
        # Checkpoints never run code when loaded: weights_only is always True.
        self._checkpoint_source = f"Checkpoint {str(checkpoint_path)!r}"
        checkpoint = read_full_checkpoint(full_path, self.checkpoint_io)  # mapped: each rank reads its part
        require_full_checkpoint(checkpoint, source=self._checkpoint_source)
        states = checkpoint.get("optimizer_states")
        if isinstance(states, list):  # upstream's full files number parameters in the module's order
            checkpoint["optimizer_states"] = [numbered_through_groups(state) for state in states]
        return checkpoint

    def _load_consolidated(self, sharded: ShardedCheckpoint) -> dict[str, Any]:
        """A sharded directory this strategy does not read in place (another strategy's, upstream Lightning's):
        every rank builds the full canonical checkpoint in memory, as ``lightning-strategies consolidate`` would."""
        self._checkpoint_source = (
            f"{sharded.source} (written by {sharded.metadata.strategy} at world size {sharded.world_size})"
        )
        return consolidate(sharded).checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Sharded parameters (DTensors) are neither read nor written inside `torch.inference_mode()`, where
        # `trainer.test(ckpt_path=...)` restores: every restore runs outside it.
        with torch.inference_mode(False):
            if self._sharded_reader is not None:
                self._load_sharded_model_state(self._sharded_reader, checkpoint, strict)
            else:
                with reading_from(checkpoint):  # a mapped file: each rank keeps its copies, not the file's pages
                    self._load_full_model_state(checkpoint, strict)

    def _load_sharded_model_state(self, reader: ShardedFormat, checkpoint: Mapping[str, Any], strict: bool) -> None:
        # Every rank checks its part (and the optimizer states it will restore); the ranks agree before any weight
        # changes, so a part that does not fit on one rank leaves every rank's weights as they were.
        refuse_unless_every_rank_fits(
            reader.problem(checkpoint, strict, self._restoring_sharded_optimizer_states(checkpoint))
        )
        if not reader.holds_optimizer_states(checkpoint):
            self._resume_without_optimizer_state(checkpoint)  # one warning; the optimizers start fresh
        reader.load_model(checkpoint, strict)

    def _load_full_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        source = self._checkpoint_source
        require_full_checkpoint(checkpoint, source=source)
        if "state_dict" not in checkpoint:
            raise CheckpointFormatError(f"{source} has no 'state_dict' (keys: {', '.join(sorted(checkpoint))}).")
        trainer = trainer_of(self.require_lightning_module())
        if trainer is not None and self._restoring_optimizers(trainer):
            if holds_optimizer_state(checkpoint):
                # Refuse a checkpoint whose optimizer states do not fit *before* changing the weights.
                self._check_optimizer_states(checkpoint["optimizer_states"])
            else:
                self._resume_without_optimizer_state(checkpoint)
        state = checkpoint["state_dict"]
        if isinstance(state, Mapping):  # older files (and upstream's) hold compiled submodules' `_orig_mod` keys
            state = canonical_keys(state)
        self._load_canonical_model_state(state, strict=strict)

    def _resume_without_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """A fit restores a checkpoint that holds no optimizer state (weights-only, full file or sharded directory):
        one warning naming what is not restored; the optimizers and LR schedulers start fresh. Elsewhere nothing."""
        trainer = trainer_of(self.require_lightning_module())
        if trainer is None or not self._restoring_optimizers(trainer):
            return
        schedulers = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
        resume_without_optimizer_state(checkpoint, len(self.optimizers), schedulers, self._checkpoint_source)

    def _restoring_optimizers(self, trainer: pl.Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING and self.lightning_restore_optimizer

    def _restoring_sharded_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether a sharded load restores the optimizer states it holds (the Trainer fits and restores them)."""
        trainer = trainer_of(self.require_lightning_module())
        reader = self._sharded_reader
        holds = reader.holds_optimizer_states(checkpoint) if reader is not None else "optimizer_states" in checkpoint
        return trainer is not None and self._restoring_optimizers(trainer) and holds

    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        """Hook: puts canonical model state into the (wrapped) model. Default: the module holds whole tensors."""
        load_model_state(self.require_lightning_module(), state, strict=strict, source=self._checkpoint_source)

    def _canonical_param_shapes(self, optimizer: Optimizer) -> list[list[torch.Size]]:
        """Hook: canonical shapes of each param group's parameters. Default: the optimizer's own parameters."""
        return param_group_shapes(optimizer)

    def _raw_optimizers(self) -> list[Optimizer]:
        return [raw_optimizer(opt) for opt in self.optimizers]

    def _check_optimizer_states(self, states: Any) -> None:
        optimizers = self._raw_optimizers()
        shapes = [self._canonical_param_shapes(optimizer) for optimizer in optimizers]
        check_optimizer_states(states, optimizers, shapes, source=self._checkpoint_source)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        with torch.inference_mode(False):
            reader, self._sharded_reader = self._sharded_reader, None  # the restore ends here
            if reader is None:
                with reading_from(checkpoint):
                    self._load_full_optimizer_states(checkpoint)
            elif reader.holds_optimizer_states(checkpoint):  # else the optimizers start fresh (warned about)
                reader.load_optimizers(checkpoint)
            # A host's copy is shared: it is removed once every rank has read what it needs of it.
            self._store_downloads.clear(barrier=lambda: self.barrier("restore read the downloaded checkpoint"))

    def _load_full_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if not holds_optimizer_state(checkpoint):
            return  # warned about in load_model_state_dict: the optimizers start fresh
        self._check_optimizer_states(states)
        for optimizer, state in zip(self._raw_optimizers(), states, strict=True):
            self._load_canonical_optimizer_state(optimizer, state)
            _optimizer_to_device(optimizer, self.root_device)
        copy_out_of_mapping(self._raw_optimizers(), checkpoint)  # nothing kept may view the file's mapping

    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """Hook: puts one canonical optimizer state into the (possibly sharded) optimizer."""
        optimizer.load_state_dict(dict(state))
