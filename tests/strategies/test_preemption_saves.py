"""Saves when a run is stopped: preemption signals leave a complete checkpoint, a failure on some ranks one clear error.

Each rank is a forked process started the way ``torchrun`` or ``srun`` starts ranks (``tests/support/ranks.py``), so
Lightning handles exceptions and signals in every rank as in a cluster job: ``OnExceptionCheckpoint`` and SLURM's
requeue handler run on every rank. Every run is bounded in time (``run_as_ranks`` kills ranks that outlive
``TIMEOUT_S``): a hang fails.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint, OnExceptionCheckpoint

from lightning_strategies import CheckpointRefusedError, FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.conftest import trainer_kwargs
from tests.support.helpers import assert_same_checkpoint_state, canonical_checkpoint
from tests.support.ranks import run_as_ranks

CASES = ["ddp_sharded", "fsdp_fairscale-full", "fsdp_fairscale-sharded", "fsdp2-full", "fsdp2-sharded"]
STOP_AT_STEP = 2  # the signal arrives during this step (the third); the checkpoint holds STOP_AT_STEP + 1 steps
TIMEOUT_S = 60.0


def _strategy(case: str) -> Any:
    if case == "ddp_sharded":
        return ShardedDDPStrategy()
    name, state_dict_type = case.split("-")
    cls = FairScaleFSDPStrategy if name == "fsdp_fairscale" else FSDP2Strategy
    return cls(state_dict_type=state_dict_type)


def _model(*args: Any, **kwargs: Any) -> StoppedModel:
    """The same initial weights every time."""
    pl.seed_everything(3, verbose=False)
    return StoppedModel(*args, **kwargs)


class StoppedModel(ConformanceModel):
    """Sends ``signum`` to its own process on the given ranks during step ``STOP_AT_STEP`` (in ``hook``), or raises."""

    def __init__(self, action: str = "none", ranks: tuple[int, ...] = (0, 1), hook: str = "training_step") -> None:
        super().__init__()
        self.action, self.ranks, self.hook = action, ranks, hook

    def _maybe_stop(self, hook: str) -> None:
        if hook != self.hook or self.trainer.global_step != STOP_AT_STEP or self.global_rank not in self.ranks:
            return
        if self.action == "raise":
            raise RuntimeError(f"rank {self.global_rank} failed on purpose")
        if self.action in ("SIGTERM", "SIGUSR1"):
            os.kill(os.getpid(), getattr(signal, self.action))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_stop("training_step")
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        self._maybe_stop("on_after_backward")


def _fit(case: str, model: StoppedModel, ckpt_path: Path | None = None, **overrides: Any) -> list[str]:
    """Fits ``model`` on two ranks; returns what ``fit`` ended with on each rank (``"returned"`` or the exception)."""
    checkpointing = any(isinstance(callback, Checkpoint) for callback in overrides.get("callbacks", []))
    overrides = {"enable_checkpointing": checkpointing, **overrides}

    def rank() -> str:
        pl.seed_everything(3, verbose=False)
        trainer = pl.Trainer(strategy=_strategy(case), **trainer_kwargs(**overrides))
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except BaseException as error:  # SIGTERMException is a SystemExit
            return f"{type(error).__name__}: {error}"
        return "returned"

    return run_as_ranks(rank, timeout=TIMEOUT_S)


def _reference(case: str, path: Path) -> Path:
    """A run that stops by itself after the steps the stopped run finished, saved the ordinary way."""
    _fit(case, _model(), max_steps=STOP_AT_STEP + 1, callbacks=[_SaveAtEnd(path)])
    return path


class _SaveAtEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _assert_resumes_exactly(case: str, checkpoint: Path, tmp_path: Path) -> None:
    """Resumed with the same strategy and saved again before any step: the same state (and the run then finishes)."""
    restored = tmp_path / "restored.ckpt"
    ended = _fit(case, _model(), ckpt_path=checkpoint, callbacks=[SaveAfterRestore(restored)])
    assert ended == ["returned", "returned"]
    assert_same_checkpoint_state(checkpoint, restored)


@pytest.mark.parametrize("case", CASES)
def test_sigterm_on_every_rank_leaves_a_complete_checkpoint_that_resumes_exactly(tmp_path: Path, case: str) -> None:
    saved = tmp_path / "on_exception.ckpt"
    ended = _fit(case, _model("SIGTERM"), callbacks=[OnExceptionCheckpoint(tmp_path)])

    assert [text.split(":")[0] for text in ended] == ["SIGTERMException", "SIGTERMException"], ended
    assert canonical_checkpoint(saved)["global_step"] == STOP_AT_STEP + 1  # the step under way when it came
    assert_same_checkpoint_state(_reference(case, tmp_path / "reference.ckpt"), saved, atol=1e-6)
    _assert_resumes_exactly(case, saved, tmp_path)


def _fake_scontrol(tmp_path: Path, checkpoint: Path) -> Path:
    """An ``scontrol`` on PATH that records, when asked to requeue, whether the checkpoint was complete by then."""
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    record = tmp_path / "requeued"
    script.write_text(
        f'#!/bin/sh\nif [ -f {checkpoint} ] || [ -f {checkpoint}/meta.pt ]; then echo "$1 $2 complete" >> {record};'
        f' else echo "$1 $2 missing" >> {record}; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return record


def _slurm_rank(rank: int) -> None:
    os.environ.update(
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="preemption-test",
    )


@pytest.mark.parametrize("case", CASES)
def test_requeue_signal_saves_between_steps_even_when_it_reaches_ranks_mid_step_at_different_points(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 gets SIGUSR1 in its forward, rank 1 after its backward: Lightning's handler saves right there, so the
    # save's collectives met the step's on the other rank. Here both save at the next step's start, then requeue.
    root = tmp_path / "root"
    saved = root / "hpc_ckpt_1.ckpt"
    record = _fake_scontrol(tmp_path, saved)
    monkeypatch.setenv("PATH", f"{record.parent / 'bin'}{os.pathsep}{os.environ['PATH']}")
    model = _model("SIGUSR1", ranks=(0,), hook="training_step")
    model_other = _model("SIGUSR1", ranks=(1,), hook="on_after_backward")

    def rank() -> str:
        local = int(os.environ["RANK"])
        _slurm_rank(local)
        pl.seed_everything(3, verbose=False)
        trainer = pl.Trainer(
            strategy=_strategy(case),
            plugins=[SLURMEnvironment(auto_requeue=True)],
            **trainer_kwargs(default_root_dir=root, max_steps=STOP_AT_STEP + 3),
        )
        trainer.fit(model if local == 0 else model_other)
        return "returned"

    started = time.monotonic()
    assert run_as_ranks(rank, timeout=TIMEOUT_S) == ["returned", "returned"]
    print(f"{case}: run with a requeue save {time.monotonic() - started:.1f} s")

    assert record.read_text().split() == ["requeue", "4242", "complete"]  # once, after the save was complete
    assert canonical_checkpoint(saved)["global_step"] == STOP_AT_STEP + 1
    assert_same_checkpoint_state(_reference(case, tmp_path / "reference.ckpt"), saved, atol=1e-6)
    _assert_resumes_exactly(case, saved, tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_failure_on_one_rank_refuses_the_save_quickly_and_keeps_the_last_checkpoint(tmp_path: Path, case: str) -> None:
    # Rank 1 raises in its step while rank 0 goes on to the step's collectives: OnExceptionCheckpoint's save on rank 1
    # would pair its collectives with rank 0's step (a hang, or a crash: measured before this fix).
    checkpoints = tmp_path / "checkpoints"
    every_step = ModelCheckpoint(dirpath=checkpoints, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    started = time.monotonic()
    ended = _fit(
        case,
        _model("raise", ranks=(1,)),
        callbacks=[every_step, OnExceptionCheckpoint(tmp_path)],
    )
    elapsed = time.monotonic() - started

    last = checkpoints / f"step={STOP_AT_STEP}.ckpt"
    assert all(text.startswith(CheckpointRefusedError.__name__) for text in ended), ended
    assert "on some ranks only" in ended[1] or "different points" in ended[1], ended[1]
    assert all(f"The last complete checkpoint of this run is {str(last)!r}" in text for text in ended), ended
    assert not (tmp_path / "on_exception.ckpt").exists()
    assert canonical_checkpoint(last)["global_step"] == STOP_AT_STEP  # intact and resumable
    assert elapsed < 30, f"the ranks took {elapsed:.1f} s to go down"


@pytest.mark.parametrize("case", ["ddp_sharded", "fsdp2-sharded"])
def test_the_same_exception_inside_a_step_on_every_rank_refuses_the_save(tmp_path: Path, case: str) -> None:
    # Inside a step sharded parameters may be gathered and the optimizer half updated: nothing consistent to save.
    ended = _fit(case, _model("raise"), callbacks=[OnExceptionCheckpoint(tmp_path)])

    assert all(text.startswith(CheckpointRefusedError.__name__) for text in ended), ended
    assert all("every rank stopped inside a step" in text for text in ended), ended
    assert all("This run has no complete checkpoint" in text for text in ended), ended
    assert not (tmp_path / "on_exception.ckpt").exists()


@pytest.mark.parametrize("case", ["ddp_sharded", "fsdp_fairscale-full", "fsdp2-full", "fsdp2-sharded"])
def test_save_after_fit_was_stopped_by_sigterm_on_every_rank(tmp_path: Path, case: str) -> None:
    # The ranks keep their process group when they all stopped between steps: a save after fit() works (upstream ddp
    # saves there too). Before, it failed with a different message per strategy.
    after = tmp_path / "after.ckpt"

    def rank() -> str:
        pl.seed_everything(3, verbose=False)
        callbacks = [OnExceptionCheckpoint(tmp_path)]
        trainer = pl.Trainer(strategy=_strategy(case), **trainer_kwargs(callbacks=callbacks, enable_checkpointing=True))
        with pytest.raises(SystemExit):
            trainer.fit(_model("SIGTERM"))
        trainer.save_checkpoint(after)
        return "saved"

    assert run_as_ranks(rank, timeout=TIMEOUT_S) == ["saved", "saved"]
    assert_same_checkpoint_state(tmp_path / "on_exception.ckpt", after)


@pytest.mark.parametrize("name", ["ddp_sharded_fork", "fsdp2_fork"])
def test_launching_process_of_a_failed_fork_run_refuses_to_save(tmp_path: Path, name: str) -> None:
    # Lightning calls on_exception hooks only in the launching process, which holds the weights the run started with.
    callbacks = [OnExceptionCheckpoint(tmp_path)]
    trainer = pl.Trainer(strategy=name, **trainer_kwargs(callbacks=callbacks, enable_checkpointing=True))
    with pytest.raises(CheckpointRefusedError, match="launching process holds none of their state"):
        trainer.fit(_model("raise"))
    assert not (tmp_path / "on_exception.ckpt").exists()
