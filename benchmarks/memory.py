"""Benchmark 4: per-rank bytes of parameters, gradients and optimizer state, sharded strategies against ``ddp``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from .config import Config
from .lightning_side import raw_optimizer, trainer
from .measure import training_state_bytes
from .models import dataset, lightning_loader, new_model

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


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """One short fit per strategy (and upstream ``ddp``); the bytes are the same on every repeat."""
    results: dict[str, Any] = {}
    steps = MEASURED_STEP + 1
    data = dataset(config.width, config.batch_size * dist.get_world_size() * steps)
    for strategy in ("ddp", *config.strategies):
        probe = _TrainingStateBytes()
        trainer(strategy, [probe], max_epochs=1).fit(
            new_model(config.width, config.depth), train_dataloaders=lightning_loader(data, config.batch_size)
        )
        results[strategy] = probe.bytes
    return results
