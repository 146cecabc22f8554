"""Asynchronous saves (``async_save=True``) under every strategy, full files and sharded directories: they resume
exactly like synchronous saves, ``ModelCheckpoint`` removes an old checkpoint only once the new one is complete, a
failed background write is raised on every rank, a SIGKILL during a save leaves the previous checkpoint resumable,
and the end of a run waits for the pending save and commits it."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies import AsyncSaveError
from lightning_strategies.checkpoint import paced_writes
from lightning_strategies.checkpoint.sharded import open_sharded, sharded_directory
from lightning_strategies.strategies import async_saves, background_priority
from lightning_strategies.strategies.async_saves import staged_bytes, staged_copy
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO
from lightning_strategies.strategies.background_priority import BACKGROUND_SWITCH_INTERVAL_S, restore
from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.strategies.gather import (
    DeferredTransfers,
    forget_fresh_copies,
    fresh_copy_count,
    is_fresh_copy,
    mark_fresh_copy,
)
from lightning_strategies.testing import SaveAfterRestore
from tests.conftest import free_loopback_port, write_json
from tests.support.helpers import (
    SAVE_FORMATS,
    STRATEGY_CLASSES,
    assert_same_checkpoint_state,
    canonical_checkpoint,
    fit,
    new_model,
)

CLASSES = STRATEGY_CLASSES
FORMATS = SAVE_FORMATS
TINY = {"limit_train_batches": 2, "limit_val_batches": 0}  # two steps an epoch, no validation: fits stay short


def strategy(
    name: str,
    state_dict_type: str,
    *,
    async_save: bool = True,
    cls: type[DirectReferenceStrategy] | None = None,
    **kwargs: Any,
) -> Any:
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    return (cls or CLASSES[name])(start_method="fork", async_save=async_save, **options, **kwargs)


def leftovers(directory: Path) -> list[str]:
    """Staging directories and temporary files of saves that did not finish (or were never swapped in)."""
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("."))


def assert_complete(path: Path) -> None:
    """``path`` is a whole checkpoint: a full file that loads, or a sharded directory whose every shard is there."""
    directory = sharded_directory(path)
    if directory is not None:
        open_sharded(directory)  # refuses a directory without meta.pt ("its save did not finish")
    checkpoint = canonical_checkpoint(path)
    assert checkpoint["state_dict"] and checkpoint["optimizer_states"]


class Gate:
    """A gate the test controls on the background writes (the ``write_in_background`` seam): a save stays pending until
    its write is let through, however fast or slow the machine, so "a save is pending here" is never left to timing.

    Writes are numbered per process from 1 (a fit's ranks are forked with the count at 0); the first ``open_first`` pass
    at once. A write held at the gate leaves ``waiting-<n>-rank<r>`` in ``directory`` — before writing its files, or
    after them (``hold="after"``: written, not committed), which the test's process sees across the forks — and goes
    on once the worker's main thread lets it through (:meth:`let_through`), or never (the test kills it there).
    """

    def __init__(self, directory: Path, *, open_first: int = 0, hold: Literal["before", "after"] = "before") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.open_first, self.hold = directory, open_first, hold
        self.started = 0  # writes this process started (one save is pending at a time: no race)
        self.let_through_up_to = open_first  # written by the worker's main thread, read by its background thread

    def __call__(self, files: Callable[[], None]) -> None:
        self.started += 1
        number = self.started
        if self.hold == "before":
            self._wait(number)
        files()
        if self.hold == "after":
            self._wait(number)

    def _wait(self, number: int) -> None:
        if number <= self.let_through_up_to:
            return
        (self.directory / f"waiting-{number}-rank{dist.get_rank()}").touch()
        deadline = time.monotonic() + 120
        while number > self.let_through_up_to:
            if time.monotonic() > deadline:  # a test that never opens the gate fails instead of hanging
                raise TimeoutError(f"the test never let background write {number} through")
            time.sleep(0.002)

    def let_through(self) -> None:
        """Lets the next write of this process through (held already, or about to be)."""
        self.let_through_up_to += 1

    def waiting(self, number: int) -> list[int]:
        """The ranks whose write ``number`` is held at the gate (or was, until let through)."""
        return sorted(int(path.name.rsplit("rank", 1)[1]) for path in self.directory.glob(f"waiting-{number}-rank*"))


def gated_until_the_ranks_meet(monkeypatch: pytest.MonkeyPatch, gate: Gate, log: Path) -> None:
    """Holds every background write at ``gate`` until the ranks next meet (``AsyncSaves.finish``: the next save, the
    end of training, teardown), and lets it through only there: each save stays pending as long as it possibly can.
    Rank 0 logs, for each save let through, whether its path existed then (``finish`` is patched in this process; the
    forked ranks inherit it)."""
    finish = async_saves.AsyncSaves.finish

    def finish_after_the_gate(self: async_saves.AsyncSaves) -> None:
        save = self._pending
        if save is not None and save.thread is not None:  # this rank writes: its write waits at the gate
            if dist.get_rank() == 0:
                with log.open("a") as file:
                    file.write(
                        json.dumps({"let_through": Path(save.target).name, "existed": Path(save.target).exists()})
                    )
                    file.write("\n")
            gate.let_through()
        finish(self)

    monkeypatch.setattr(async_saves, "write_in_background", gate)
    monkeypatch.setattr(async_saves.AsyncSaves, "finish", finish_after_the_gate)


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_async_saves_resume_exactly_like_synchronous_saves(tmp_path: Path, name: str, state_dict_type: str) -> None:
    saved = {}
    for kind, async_save in (("sync", False), ("async", True)):
        directory = tmp_path / kind
        checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
        fit(
            strategy(name, state_dict_type, async_save=async_save),
            new_model(),
            callbacks=[checkpoints],
            enable_checkpointing=True,
            **TINY,
        )
        saved[kind] = directory / "epoch=1.ckpt"
        assert sorted(path.name for path in directory.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    # The same state as the synchronous save, in the same format.
    assert_same_checkpoint_state(saved["sync"], saved["async"])
    assert (sharded_directory(saved["async"]) is not None) == (state_dict_type == "sharded")
    restored = tmp_path / "restored.ckpt"
    fit(
        strategy(name, state_dict_type),
        new_model(seed=11),
        ckpt_path=saved["async"],
        callbacks=[SaveAfterRestore(restored)],
        max_epochs=3,
        **TINY,
    )
    assert_same_checkpoint_state(saved["async"], restored)


class RemovalRecorder(AtomicTorchCheckpointIO):
    """Records, for each checkpoint removed, the other checkpoints in its directory and whether each was complete."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log

    def remove_checkpoint(self, path: Any) -> None:
        others = {}
        for other in Path(path).parent.iterdir():
            if other.name.startswith(".") or other == Path(path):
                continue
            try:
                assert_complete(other)
                others[other.name] = True
            except Exception:
                others[other.name] = False
        with self.log.open("a") as log:
            log.write(json.dumps({"removed": Path(path).name, "others": others}) + "\n")
        super().remove_checkpoint(path)


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_model_checkpoint_removes_an_old_checkpoint_only_once_the_new_one_is_complete(
    tmp_path: Path, name: str, state_dict_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated_until_the_ranks_meet(monkeypatch, Gate(tmp_path / "gate"), tmp_path / "let-through.log")
    requests = tmp_path / "requested.log"
    defer_removal = async_saves.AsyncSaves.defer_removal

    def recording_deferrals(self: async_saves.AsyncSaves, remove: Callable[[], None]) -> bool:
        pending = self._pending
        deferred = defer_removal(self, remove)
        if dist.get_rank() == 0:  # which removal ModelCheckpoint asked for, and whether the save it waits for existed
            entry = {"removal": Path(remove.args[0]).name, "deferred": deferred}  # type: ignore[attr-defined]
            if pending is not None:
                entry.update(pending=Path(pending.target).name, pending_existed=Path(pending.target).exists())
            with requests.open("a") as file:
                file.write(json.dumps(entry) + "\n")
        return deferred

    monkeypatch.setattr(async_saves.AsyncSaves, "defer_removal", recording_deferrals)
    directory, log = tmp_path / "checkpoints", tmp_path / "removed.log"
    fit(
        strategy(name, state_dict_type, checkpoint_io=RemovalRecorder(log)),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=1)],
        enable_checkpointing=True,
        max_epochs=3,
        **TINY,
    )

    assert sorted(path.name for path in directory.iterdir()) == ["epoch=2-step=6.ckpt", "last.ckpt"]
    for path in directory.iterdir():
        assert_complete(path)
    removals = [json.loads(line) for line in log.read_text().splitlines()]
    assert [entry["removed"] for entry in removals] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    for entry in removals:  # when each old one went, its successor was there, complete
        assert all(entry["others"].values()) and len(entry["others"]) == 2, entry
    assert not leftovers(directory)
    # Not vacuous: each removal was asked for while its successor was still held at the gate, not on disk yet.
    asked = [json.loads(line) for line in requests.read_text().splitlines()]
    assert [entry for entry in asked if entry["deferred"]] == [
        {
            "removal": "epoch=0-step=2.ckpt",
            "deferred": True,
            "pending": "epoch=1-step=4.ckpt",
            "pending_existed": False,
        },
        {
            "removal": "epoch=1-step=4.ckpt",
            "deferred": True,
            "pending": "epoch=2-step=6.ckpt",
            "pending_existed": False,
        },
    ]
    let_through = [json.loads(line) for line in (tmp_path / "let-through.log").read_text().splitlines()]
    saves = ["epoch=0-step=2.ckpt", "last.ckpt", "epoch=1-step=4.ckpt", "last.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    assert [entry["let_through"] for entry in let_through] == saves  # each held until the ranks next met


def failing_on(rank: int, *, after_writing: bool) -> Callable[[Callable[[], None]], None]:
    """A background writer that fails on ``rank`` (the others' writes succeed): before writing, or after writing its
    files (a DCP write's collectives need every rank; a real failure inside one is reported to every rank by DCP)."""

    def write(files: Callable[[], None]) -> None:
        failing = dist.get_rank() == rank
        if not failing or after_writing:
            files()
        if failing:
            raise OSError(f"the store refused the write of rank {rank}")

    return write


def recording_errors(cls: type[DirectReferenceStrategy], directory: Path) -> type[DirectReferenceStrategy]:
    """``cls`` that writes what each rank's ``save_checkpoint`` raised to ``<dir>/error-rank<r>.json`` (a fork
    worker's exception ends it without Lightning's ``on_exception`` hooks)."""

    class Recording(cls):  # type: ignore[valid-type,misc]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            try:
                super().save_checkpoint(*args, **kwargs)
            except Exception as error:
                write_json(directory / f"error-rank{self.global_rank}.json", [type(error).__name__, str(error)])
                raise

    return Recording


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_a_failed_background_write_is_raised_on_every_rank(
    tmp_path: Path, name: str, state_dict_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = 0 if state_dict_type == "full" else 1  # rank 0 alone writes a full file; rank 1 fails alone
    monkeypatch.setattr(async_saves, "write_in_background", failing_on(writer, after_writing=writer == 1))
    directory = tmp_path / "checkpoints"
    with pytest.raises(Exception, match="the store refused"):
        fit(
            strategy(name, state_dict_type, cls=recording_errors(CLASSES[name], tmp_path)),
            new_model(),
            callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)],
            enable_checkpointing=True,
            max_epochs=1,
            **TINY,
        )

    for rank in (0, 1):  # raised by the next save (last.ckpt), on every rank
        kind, message = json.loads((tmp_path / f"error-rank{rank}.json").read_text())
        assert kind == AsyncSaveError.__name__
        assert f"failed on rank {writer} (OSError: the store refused" in message
        assert "epoch=0-step=2.ckpt" in message and "previous checkpoint" in message
    # Nothing of the failed save appeared, and its staging directory is gone.
    assert not directory.exists() or not list(directory.iterdir())


class SaveEveryStep(pl.Callback):
    """Saves ``path`` after every step; rank 0 reports each step whose save is committed (at the next save)."""

    def __init__(self, path: Path, committed: Any) -> None:
        self.path, self.committed = path, committed

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)  # commits the previous step's save first
        if trainer.is_global_zero and trainer.global_step > 1:
            self.committed.put(trainer.global_step - 1)


def _save_in_a_loop(name: str, state_dict_type: str, path: str, committed: Any, port: int, gate: Gate) -> None:
    os.setsid()  # one process group with the ranks it forks: the test kills them all at once
    os.environ["MASTER_PORT"] = str(port)
    async_saves.write_in_background = gate  # the second save's write is held: the kill lands inside it
    callbacks = [SaveEveryStep(Path(path), committed)]
    fit(strategy(name, state_dict_type), new_model(), callbacks=callbacks, max_epochs=100_000, **TINY)


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_sigkill_during_an_async_save_leaves_the_previous_checkpoint_resumable(
    tmp_path: Path, name: str, state_dict_type: str
) -> None:
    path = tmp_path / "last.ckpt"
    # The first save passes; the second is held before its write (a full file: nothing of it is on disk) or, for a
    # sharded directory, after every rank wrote its files (staged, not committed: the sharpest point to be killed at).
    sharded = state_dict_type == "sharded"
    gate = Gate(tmp_path / "gate", open_first=1, hold="after" if sharded else "before")
    context = multiprocessing.get_context("fork")
    committed = context.Queue()
    saver = context.Process(
        target=_save_in_a_loop, args=(name, state_dict_type, str(path), committed, free_loopback_port(), gate)
    )
    saver.start()
    try:
        first = committed.get(timeout=120)  # the first save is complete; the second one is pending
        writers = [0, 1] if sharded else [0]  # rank 0 alone writes a full file
        deadline = time.monotonic() + 120
        while gate.waiting(2) != writers and time.monotonic() < deadline and saver.is_alive():
            time.sleep(0.01)
        held = gate.waiting(2)
    finally:
        os.killpg(saver.pid or 0, signal.SIGKILL)
        saver.join(timeout=30)

    assert held == writers  # not vacuous: the kill landed while the second save's write was held, uncommitted
    assert (sharded_directory(path) is not None) == (state_dict_type == "sharded")
    step = canonical_checkpoint(path)["global_step"]  # raises on a torn or mixed checkpoint
    assert step == first  # the previous checkpoint, whole
    # It resumes (the synchronous flow cleans what the killed save left).
    fit(strategy(name, state_dict_type, async_save=False), new_model(seed=11), ckpt_path=path, max_steps=step + 1)


def committing_at_teardown(cls: type[DirectReferenceStrategy]) -> type[DirectReferenceStrategy]:
    """``cls`` whose ``on_train_end`` leaves the pending save alone: only ``teardown`` can commit it."""

    class Late(cls):  # type: ignore[valid-type,misc]
        def on_train_end(self) -> None:
            super(DirectReferenceStrategy, self).on_train_end()

    return Late


class ExistsAtTrainEnd(pl.Callback):
    """Records on rank 0 whether ``path`` exists when training ends (before the strategy's teardown)."""

    def __init__(self, path: Path, record: Path) -> None:
        self.path, self.record = path, record

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            write_json(self.record, self.path.exists())


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_teardown_waits_for_the_pending_save_and_commits_it(
    tmp_path: Path, name: str, state_dict_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated_until_the_ranks_meet(monkeypatch, Gate(tmp_path / "gate"), tmp_path / "let-through.log")
    directory, record = tmp_path / "checkpoints", tmp_path / "exists.json"
    path = directory / "epoch=0.ckpt"
    fit(
        strategy(name, state_dict_type, cls=committing_at_teardown(CLASSES[name])),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, filename="{epoch}"), ExistsAtTrainEnd(path, record)],
        enable_checkpointing=True,
        max_epochs=1,
        **TINY,
    )

    assert json.loads(record.read_text()) is False  # still being written when training ended
    # Held at the gate until teardown let it through, its path still empty then.
    let_through = [json.loads(line) for line in (tmp_path / "let-through.log").read_text().splitlines()]
    assert let_through == [{"let_through": "epoch=0.ckpt", "existed": False}]
    assert_complete(path)  # teardown waited for it and committed it
    assert canonical_checkpoint(path)["global_step"] == 2
    assert not leftovers(directory)


def test_the_staging_copy_shares_fresh_gathered_tensors_and_copies_everything_else() -> None:
    forget_fresh_copies()
    try:
        fresh = mark_fresh_copy(torch.arange(12.0))
        live = torch.nn.Linear(3, 2).weight
        staged = staged_copy({"fresh": fresh, "view": fresh[4:8].view(2, 2), "live": live, "user": torch.ones(3)})

        assert staged["fresh"].untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr()  # shared
        assert staged["view"].untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr()  # a view counts
        assert torch.equal(staged["view"], fresh[4:8].view(2, 2))
        assert staged["live"].untyped_storage().data_ptr() != live.untyped_storage().data_ptr()  # copied
        assert staged["user"].untyped_storage().data_ptr() != 0 and not is_fresh_copy(staged["user"])
        assert staged_bytes(staged) == (live.numel() + 3) * 4  # only the copies count
    finally:
        forget_fresh_copies()
    assert fresh_copy_count() == 0
    assert not is_fresh_copy(fresh)  # forgotten: a later save copies it


def test_a_freed_fresh_copy_no_longer_counts() -> None:
    forget_fresh_copies()
    fresh = mark_fresh_copy(torch.ones(1000))
    del fresh  # freed: its memory may hold another tensor now
    other = torch.ones(1000)
    assert not is_fresh_copy(other)
    forget_fresh_copies()


class FreshCopiesAtTrainEnd(pl.Callback):
    """Records per rank, when training ends, how many fresh copies are recorded and the last save's staged bytes."""

    def __init__(self, record: Path) -> None:
        self.record = record

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, DirectReferenceStrategy)
        write_json(
            self.record.with_name(f"{self.record.name}.{trainer.global_rank}"),
            {"fresh": fresh_copy_count(), "staged": strategy._async_saves.last_staged_bytes},
        )


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


@pytest.mark.parametrize("name", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_an_async_full_save_shares_the_gathered_state_instead_of_copying_it(tmp_path: Path, name: str) -> None:
    record, directory = tmp_path / "fresh.json", tmp_path / "checkpoints"
    fit(
        strategy(name, "full"),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, filename="{epoch}"), FreshCopiesAtTrainEnd(record)],
        enable_checkpointing=True,
        max_epochs=1,
        **TINY,
    )

    ranks = [json.loads(record.with_name(f"{record.name}.{rank}").read_text()) for rank in range(2)]
    assert [rank["fresh"] for rank in ranks] == [0, 0]  # nothing recorded outlives its save
    saved = canonical_checkpoint(directory / "epoch=0.ckpt")
    model, optimizer = _tensor_bytes(saved["state_dict"]), _tensor_bytes(saved["optimizer_states"])
    staged = ranks[0]["staged"]
    small = 64  # tensors of Lightning's own state and Adam's step counts: copied, as every tensor not gathered
    if name == "ddp_sharded":  # the parameters are live tensors (copied); the gathered optimizer state is shared
        assert model <= staged < model + small
    elif name == "fsdp2":  # every tensor of the checkpoint was gathered (or copied by the gather): none copied again
        assert staged < small
    else:  # the gathered flat shards are shared; buffers and Adam's step counts are small copies
        assert staged < (model + optimizer) / 4


@pytest.mark.parametrize("name", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_an_async_full_save_gathers_to_rank0_in_the_background_thread_of_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    run = DeferredTransfers.run

    def recording_run(self: DeferredTransfers, group: Any) -> None:
        on_main_thread = threading.current_thread() is threading.main_thread()
        with (tmp_path / f"transfers.{dist.get_rank()}").open("a") as file:
            file.write(json.dumps({"held": len(self), "main_thread": on_main_thread}) + "\n")
        run(self, group)

    monkeypatch.setattr(DeferredTransfers, "run", recording_run)  # the forked ranks inherit it
    directory = tmp_path / "checkpoints"
    fit(
        strategy(name, "full"),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, filename="{epoch}")],
        enable_checkpointing=True,
        max_epochs=1,
        **TINY,
    )

    for rank in range(2):
        runs = [json.loads(line) for line in (tmp_path / f"transfers.{rank}").read_text().splitlines()]
        assert runs == [{"held": runs[0]["held"], "main_thread": False}]  # the one save's transfers, off the step loop
        assert runs[0]["held"] > 0
    assert_complete(directory / "epoch=0.ckpt")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have priorities of their own on Linux only")
@pytest.mark.parametrize(("name", "kind"), FORMATS)
def test_the_background_write_and_its_gloo_threads_run_under_sched_idle_beside_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    recorded = threading.Event()  # each forked rank has its own
    group_threads: list[int] = []

    def policy(native_id: int) -> int:
        return os.sched_getscheduler(native_id)

    def recording_priorities(files: Callable[[], None]) -> None:
        write_json(
            tmp_path / f"priority.{dist.get_rank()}",
            {
                "writer": policy(threading.get_native_id()),
                "steps": policy(os.getpid()),  # the main thread's id is the process's
                "gloo": [policy(native_id) for native_id in group_threads],
                "switch_interval": sys.getswitchinterval(),
            },
        )
        recorded.set()
        files()

    def restore_once_recorded(native_ids: Any) -> None:  # the step loop may wait for the write before it ran
        if dist.get_rank() == 0:  # rank 0 writes in both formats
            recorded.wait(timeout=60)
        restore(native_ids)

    original_lower = background_priority.lower

    def noting_the_group(native_ids: Any) -> list[int]:
        lowered = original_lower(native_ids)
        group_threads[:] = lowered
        return lowered

    monkeypatch.setattr(async_saves, "write_in_background", recording_priorities)  # the forked ranks inherit it
    monkeypatch.setattr(background_priority, "restore", restore_once_recorded)
    monkeypatch.setattr(background_priority, "lower", noting_the_group)
    directory = tmp_path / "checkpoints"
    fit(
        strategy(name, kind),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, filename="{epoch}")],
        enable_checkpointing=True,
        max_epochs=1,
        **TINY,
    )

    priority = json.loads((tmp_path / "priority.0").read_text())  # rank 0 writes in both formats
    assert priority["steps"] == os.SCHED_OTHER
    assert priority["writer"] == os.SCHED_IDLE
    assert len(priority["gloo"]) >= 1  # gloo's loop thread and its workers
    assert set(priority["gloo"]) == {os.SCHED_IDLE}
    assert priority["switch_interval"] == BACKGROUND_SWITCH_INTERVAL_S  # the steps get the GIL back quickly
    assert_complete(directory / "epoch=0.ckpt")


@pytest.mark.parametrize(("name", "kind"), FORMATS)
def test_a_paced_background_write_pauses_until_the_step_loop_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    # Every pause would last for hours and no budget would end it: only the step loop's hurry does.
    monkeypatch.setattr(paced_writes, "WRITE_SLICE_BYTES", 1024)  # the tiny model's files pause too
    monkeypatch.setattr(paced_writes, "PAUSE_PER_SECOND_WORKED", 1e6)
    monkeypatch.setattr(async_saves, "WRITE_SHARE_OF_INTERVAL", 1e6)
    pause = paced_writes.Pacing.pause
    pausing = threading.Event()  # rank 0's paced write reached a pause (each forked rank has its own)

    def recording_pauses(self: paced_writes.Pacing, written: int) -> None:
        if self.budget_s > 0 and not self.hurried:
            pausing.set()
        before = self.paused_s
        pause(self, written)
        if self.paused_s > before:  # this pause waited, and ended: the step loop hurried it
            write_json(tmp_path / f"paused.{dist.get_rank()}", {"hurried": self.hurried})

    finish = async_saves.AsyncSaves.finish

    def finish_once_pausing(self: async_saves.AsyncSaves) -> None:  # the step loop waits only once the write pauses
        save = self._pending
        if dist.get_rank() == 0 and save is not None and save.thread is not None and save.pacing.budget_s > 0:
            if not pausing.wait(timeout=60):
                raise TimeoutError("the paced write never paused")
            pausing.clear()
        finish(self)

    monkeypatch.setattr(paced_writes.Pacing, "pause", recording_pauses)  # the forked ranks inherit both
    monkeypatch.setattr(async_saves.AsyncSaves, "finish", finish_once_pausing)
    directory = tmp_path / "checkpoints"
    started = time.monotonic()
    fit(
        strategy(name, kind),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)],
        enable_checkpointing=True,
        max_epochs=2,
        **TINY,
    )

    assert time.monotonic() - started < 120  # no pause outlasted the step loop's wait
    assert json.loads((tmp_path / "paused.0").read_text()) == {"hurried": True}  # rank 0 writes in both formats
    saved = sorted(path.name for path in directory.iterdir() if not path.name.startswith("."))
    assert saved == [f"epoch={step // 3}-step={step}.ckpt" for step in (1, 2, 3, 4)]
    for path in directory.iterdir():
        assert_complete(path)


@contextmanager
def a_lowered_background_thread() -> Iterator[tuple[int | None, int]]:
    """A live thread that lowered itself (``background_priority.lower_this_thread``), until the block ends: what that
    returned, and the thread's native id."""
    started: dict[str, Any] = {}
    release, ready = threading.Event(), threading.Event()

    def background() -> None:
        started["lowered"] = background_priority.lower_this_thread()
        started["native_id"] = threading.get_native_id()
        ready.set()
        release.wait(timeout=60)

    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    try:
        assert ready.wait(timeout=60)
        yield started["lowered"], started["native_id"]
    finally:
        release.set()
        thread.join()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have priorities of their own on Linux only")
@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority again needs root (or CAP_SYS_NICE)")
def test_a_lowered_thread_gets_the_calling_threads_policy_and_niceness_back() -> None:
    with a_lowered_background_thread() as (lowered, native_id):
        assert lowered == native_id
        assert os.sched_getscheduler(native_id) == os.SCHED_IDLE

        restore(native_id)

        assert os.sched_getscheduler(native_id) == os.sched_getscheduler(0)
        assert os.getpriority(os.PRIO_PROCESS, native_id) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have priorities of their own on Linux only")
def test_where_sched_idle_is_refused_the_background_thread_runs_ten_nice_levels_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*args: Any) -> None:
        raise PermissionError("SCHED_IDLE refused (a sandbox)")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    steps = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with a_lowered_background_thread() as (lowered, native_id):
        assert lowered == native_id
        assert os.sched_getscheduler(native_id) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, native_id) == min(19, steps + background_priority.BACKGROUND_NICENESS)


def test_the_switch_interval_is_short_while_any_background_write_runs_and_restored_after_the_last() -> None:
    before = sys.getswitchinterval()
    with background_priority.quick_gil_handoffs():
        with background_priority.quick_gil_handoffs():  # a second strategy's write in the same process
            assert sys.getswitchinterval() == BACKGROUND_SWITCH_INTERVAL_S
        assert sys.getswitchinterval() == BACKGROUND_SWITCH_INTERVAL_S
    assert sys.getswitchinterval() == before


def test_a_switch_interval_the_user_set_during_a_write_is_kept() -> None:
    before = sys.getswitchinterval()
    try:
        with background_priority.quick_gil_handoffs():
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


class TakeStateWithoutSaving(pl.Callback):
    """After the first step, takes the checkpoint's model state on every rank and saves nothing (as a callback that
    reads ``lightning_module_state_dict()`` would)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.strategy.lightning_module_state_dict()


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])  # their model states are gathered
def test_a_full_state_taken_without_a_save_leaves_the_next_async_save_as_a_synchronous_one(
    tmp_path: Path, name: str
) -> None:
    saved = {}
    for kind, async_save in (("sync", False), ("async", True)):
        directory = tmp_path / kind
        fit(
            strategy(name, "full", async_save=async_save),
            new_model(),
            callbacks=[TakeStateWithoutSaving(), ModelCheckpoint(dirpath=directory, filename="{epoch}")],
            enable_checkpointing=True,
            max_epochs=1,
            **TINY,
        )
        saved[kind] = directory / "epoch=0.ckpt"

    assert_same_checkpoint_state(saved["sync"], saved["async"])  # the held-back gathers of the state were dropped
