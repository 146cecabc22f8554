"""A sharded save replaces the previous checkpoint only when it is whole: SIGKILL at any point or a full disk leaves the
previous one resumable; temporary names are unique per save and what killed saves left is cleaned."""

from __future__ import annotations

import builtins
import errno
import io
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.checkpoint import atomic
from lightning_strategies.checkpoint.atomic import DiskFullError, atomic_torch_save
from lightning_strategies.checkpoint.sharded import resolve_sharded_directory, sharded_directory
from lightning_strategies.cli.consolidate import consolidate_checkpoint
from tests.conftest import free_loopback_port
from tests.support.helpers import fit, new_model

STRATEGIES: dict[str, type[FairScaleFSDPStrategy | FSDP2Strategy]] = {
    "fsdp_fairscale": FairScaleFSDPStrategy,
    "fsdp2": FSDP2Strategy,
}
KILLS_PER_FORMAT = 12


def _sharded(name: str) -> FairScaleFSDPStrategy | FSDP2Strategy:
    return STRATEGIES[name](start_method="fork", state_dict_type="sharded")


class SaveEveryStep(pl.Callback):
    """Saves the sharded checkpoint at ``path`` after every step; rank 0 reports each finished save."""

    def __init__(self, path: Path, saved: Any = None) -> None:
        self.path, self.saved = path, saved

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)
        if trainer.is_global_zero and self.saved is not None:
            self.saved.put(trainer.global_step)


def _save_in_a_loop(name: str, path: str, saved: Any, port: int) -> None:
    os.setsid()  # one process group with the ranks it forks: the test kills them all at once
    os.environ["MASTER_PORT"] = str(port)
    fit(_sharded(name), new_model(), callbacks=[SaveEveryStep(Path(path), saved)], max_epochs=100_000)


def _resumable_step(path: Path, out: Path) -> int:
    """Reads every shard of ``path`` as a resume does (ids, ranks, sizes) and returns its global step."""
    consolidate_checkpoint(path, out, force=True, show_progress=False)
    step: int = torch.load(out, weights_only=True)["global_step"]
    return step


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_sigkill_at_random_points_of_sharded_saves_always_leaves_a_resumable_checkpoint(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / "last.ckpt"
    context = multiprocessing.get_context("fork")
    generator = random.Random(name)
    steps, inside_a_save = set(), 0
    started = time.monotonic()
    for _ in range(KILLS_PER_FORMAT):
        saved = context.Queue()
        saver = context.Process(target=_save_in_a_loop, args=(name, str(path), saved, free_loopback_port()))
        saver.start()
        try:
            first = saved.get(timeout=120)  # one complete save exists from here on
            time.sleep(generator.uniform(0.0, 0.4))  # then kill everything somewhere inside a later save
        finally:
            os.killpg(saver.pid or 0, signal.SIGKILL)
            saver.join(timeout=30)
        inside_a_save += any(".saving-" in sibling.name for sibling in tmp_path.iterdir())
        step = _resumable_step(path, tmp_path / "consolidated.ckpt")  # raises on a torn or mixed directory
        assert step >= first
        steps.add(step)
    print(f"{name}: {KILLS_PER_FORMAT} kills in {time.monotonic() - started:.1f} s, {inside_a_save} inside a save")
    assert len(steps) > 1  # the kills landed at different points of the run
    fit(_sharded(name), new_model(seed=11), ckpt_path=path, max_steps=max(steps) + 1)  # and it does resume


# ---------------------------------------------------------------------------------------------- a full disk


class _FullDisk:
    """A file on a disk with ``budget`` bytes left: the write that crosses it writes what fits and raises ENOSPC."""

    def __init__(self, file: Any, budget: list[int]) -> None:
        self._file, self._budget = file, budget

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._budget[0]:
            self._file.write(view[: self._budget[0]])
            self._budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= len(view)
        written: int = self._file.write(view)
        return written

    def __getattr__(self, name: str) -> Any:  # tell, seek, flush, fileno, close, ...: the real file's
        return getattr(self._file, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()


def fill_disk_under(monkeypatch: pytest.MonkeyPatch, directory: Path, budget: int) -> None:
    """Until the test ends, files opened for writing under ``directory`` share ``budget`` free bytes (per process)."""
    real_open = builtins.open
    left = [budget]

    def open_on_a_full_disk(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        where = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.path.abspath(file)
        if any(flag in mode for flag in "wax+") and where.startswith(str(directory)):
            return _FullDisk(handle, left)
        return handle

    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)
    monkeypatch.setattr(io, "open", open_on_a_full_disk)


class SaveAtEpochEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_full_disk_during_a_sharded_save_is_reported_and_the_previous_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    fit(_sharded(name), new_model(), callbacks=[SaveAtEpochEnd(path)], max_epochs=1)
    step = _resumable_step(path, tmp_path / "before.ckpt")

    fill_disk_under(monkeypatch, path.parent, budget=1500)
    with pytest.raises(Exception, match=r"Saving checkpoint .*last.ckpt' failed: the disk is full") as failed:
        fit(_sharded(name), new_model(seed=5), callbacks=[SaveAtEpochEnd(path)], max_epochs=2)
    assert "previous checkpoint at that path is unchanged" in str(failed.value)
    monkeypatch.undo()

    assert _resumable_step(path, tmp_path / "after.ckpt") == step
    before, after = (torch.load(tmp_path / f"{when}.ckpt", weights_only=True) for when in ("before", "after"))
    assert all(torch.equal(value, after["state_dict"][key]) for key, value in before["state_dict"].items())
    fit(_sharded(name), new_model(seed=11), ckpt_path=path, max_epochs=2)


def test_a_full_disk_during_a_full_save_is_reported_and_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model.ckpt"
    atomic_torch_save({"version": 1}, target)
    fill_disk_under(monkeypatch, tmp_path, budget=100)
    with pytest.raises(DiskFullError, match="the disk is full"):
        atomic_torch_save({"version": 2, "weights": torch.zeros(1000)}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["model.ckpt"]


# ---------------------------------------------------------------------------------------------- temporary names


def test_concurrent_saves_to_one_path_never_share_a_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    failures: list[BaseException] = []

    def save_twenty_times(worker: int) -> None:
        for version in range(20):
            try:
                atomic_torch_save({"worker": worker, "weights": torch.full((50_000,), float(version))}, target)
            except BaseException as error:  # collected: the test reports every failed save
                failures.append(error)

    threads = [threading.Thread(target=save_twenty_times, args=(worker,)) for worker in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert torch.load(target, weights_only=True)["worker"] in (0, 1)
    assert [path.name for path in tmp_path.iterdir()] == ["model.ckpt"]


def test_temporary_files_of_killed_savers_are_removed_by_the_next_save(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid no longer runs, as for a saver killed mid-save
    host = socket.gethostname()
    stale = tmp_path / f".model.ckpt.partial-{host}-{finished.pid}-abc123"
    live = tmp_path / f".model.ckpt.partial-{host}-{os.getpid()}-def456"  # a save in progress in this process
    stale.write_bytes(b"half a checkpoint")
    live.write_bytes(b"being written")

    atomic_torch_save({"version": 1}, tmp_path / "model.ckpt")

    assert not stale.exists() and live.exists()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_sharded_save_removes_what_killed_saves_left_next_to_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.saving-0123abcd").mkdir()  # a staging directory of a killed save
    (tmp_path / ".last.ckpt.saving-0123abcd" / "rank0.pt").write_bytes(b"partial")

    fit(_sharded(name), new_model(), callbacks=[SaveAtEpochEnd(path)], max_epochs=2)  # saves twice: replaces too

    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["last.ckpt"]


def _directory_with(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "meta.pt").write_text(content)
    return path


def test_without_an_atomic_exchange_two_renames_replace_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)  # a filesystem without RENAME_EXCHANGE
    target = _directory_with(tmp_path / "last.ckpt", "previous")
    staging = _directory_with(tmp_path / ".last.ckpt.saving-1", "new")

    atomic.replace_directory(staging, target, "1")

    assert (target / "meta.pt").read_text() == "new"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_save_killed_between_its_two_renames_leaves_the_previous_directory_where_loaders_find_it(
    tmp_path: Path,
) -> None:
    # The state a kill leaves between `target -> replaced` and `staging -> target` (no atomic exchange).
    replaced = _directory_with(atomic.replaced_name(tmp_path / "last.ckpt", "1"), "previous")
    _directory_with(tmp_path / ".last.ckpt.saving-1", "new")

    assert resolve_sharded_directory(tmp_path / "last.ckpt") == replaced
    assert sharded_directory(tmp_path / "last.ckpt") == replaced
