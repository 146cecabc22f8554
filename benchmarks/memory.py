"""Benchmark 4: per-rank bytes of parameters, gradients and optimizer state, sharded strategies against ``ddp``; and
``fsdp2`` against upstream's ``FSDPStrategy`` (torch FSDP1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from .config import UPSTREAM_FSDP, UPSTREAM_PEER, Config, shards_itself
from .lightning_side import raw_optimizer, strategy_for, trainer
from .measure import training_state_bytes
from .models import lightning_loader, workload

MEASURED_STEP = 1  # the second step: the optimizer already holds state, the gradients are fresh


class _TrainingStateBytes(pl.Callback):
    """Counts after the measured step's backward: gradients are fresh and the optimizer holds state.

    Not in ``on_before_optimizer_step``: a callback that overrides it makes the sharded strategies hand it complete
    gradients (``strategy.complete_gradients()``, for ``grad_norm``), which is what such a callback costs, not what
    training holds.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == MEASURED_STEP:
            wrapper = trainer.strategy.model
            if wrapper is None:
                raise RuntimeError("The strategy has no model during fit.")
            self.bytes = training_state_bytes(wrapper.parameters(), raw_optimizer(trainer.strategy.optimizers[0]))


def strategies(config: Config) -> list[str]:
    """Upstream ``ddp``, the compared strategies of ours and, with ``fsdp2``, upstream's ``FSDPStrategy``."""
    return ["ddp", *config.strategies, *([UPSTREAM_FSDP] if UPSTREAM_PEER in config.strategies else [])]


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """One short fit per strategy of :func:`strategies`; the bytes are the same on every repeat."""
    results: dict[str, Any] = {}
    work = workload(config)
    data = work.data(work.batch_size * dist.get_world_size() * (MEASURED_STEP + 1))
    for strategy in strategies(config):
        probe = _TrainingStateBytes()
        model = work.new_model(shards_itself=shards_itself(strategy))
        trainer(strategy_for(strategy, model), [probe], max_epochs=1).fit(
            model, train_dataloaders=lightning_loader(data, work.batch_size)
        )
        results[strategy] = probe.bytes
    return results
