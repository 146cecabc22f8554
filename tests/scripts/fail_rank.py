"""Makes one rank raise in a training step, in a checkpoint save or in a checkpoint load; the others must not hang.

Usage: python fail_rank.py STRATEGY PHASE OUT_DIR [FAILING_RANK [CKPT_PATH]]

PHASE is ``step``, ``save`` or ``load`` (``load`` resumes from CKPT_PATH), or ``stuck``: the failing rank raises in
a step while the others sleep in it, outside any collective; ``none`` fails nowhere. With
``FAIL_RANK_CKPT_ONLY_ON_RANK=<r>`` only local rank ``r`` resumes from CKPT_PATH. Run directly, the strategy's plain
name starts one script per rank (Lightning's subprocess launcher); the tests import :func:`fit_failing` for
``*_fork`` names. Every rank writes ``OUT_DIR/pid-rank<r>`` once its process group is up; the launching process,
when its run failed, writes ``OUT_DIR/children.json``: the exit codes of the ranks it started (``null``: still running).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_strategies  # noqa: F401  (registers the strategy names)
from lightning_strategies.testing import ConformanceModel

PHASES = ("step", "stuck", "save", "load", "none")


class FailingRank(Exception):
    """The injected failure (a distinct type, so tests can tell it from the errors of the ranks it takes down)."""


class FailingModel(ConformanceModel):
    """Raises :class:`FailingRank` on one rank in one phase; every rank records its pid when the run starts."""

    def __init__(self, phase: str, failing_rank: int, out: str) -> None:
        super().__init__()
        self.phase, self.failing_rank, self.out = phase, failing_rank, out

    def _fail(self, phase: str) -> None:
        if phase == self.phase and self.global_rank == self.failing_rank:
            # When it failed, for the tests to measure how long the other ranks take to go down.
            (Path(self.out) / "failed-at").write_text(repr(time.time()))
            raise FailingRank(f"rank {self.global_rank} failed on purpose in phase {phase!r}")

    def on_fit_start(self) -> None:
        (Path(self.out) / f"pid-rank{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            self._fail("step")  # the other ranks go on to the gradient all-reduce of this step
            self._fail("stuck")
            if self.phase == "stuck":
                time.sleep(600)  # the other ranks are busy outside any collective: only a kill stops them
        return super().training_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._fail("save")  # the other ranks go on to write the file and wait in the save's barrier

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._fail("load")  # the other ranks go on to load the state (collectives for sharded strategies)


def fit_failing(
    strategy: Any, phase: str, out: Path, failing_rank: int = 1, ckpt_path: Path | None = None, **overrides: Any
) -> pl.Trainer:
    """Fits :class:`FailingModel` for up to two epochs, saving a checkpoint at the end of each (raises its error)."""
    pl.seed_everything(3, verbose=False)
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "callbacks": [ModelCheckpoint(dirpath=out / "checkpoints", filename="{epoch}", save_top_k=-1)],
        **overrides,
    }
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    model = FailingModel(phase, failing_rank, str(out))
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except BaseException:
        launcher = trainer.strategy.launcher
        children = getattr(launcher, "procs", None)
        if children:
            codes = [child.poll() if hasattr(child, "poll") else child.exitcode for child in children]
            (out / "children.json").write_text(json.dumps(codes))
        raise
    return trainer


if __name__ == "__main__":
    strategy_name, phase, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    failing = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    ckpt = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    only_on = os.environ.get("FAIL_RANK_CKPT_ONLY_ON_RANK")  # a rank-dependent ckpt_path (the agreement test)
    if only_on is not None and os.environ.get("LOCAL_RANK", "0") != only_on:
        ckpt = None
    if phase not in PHASES:
        raise SystemExit(f"PHASE must be one of {PHASES}, got {phase!r}")
    fit_failing(strategy_name, phase, out, failing, ckpt)
