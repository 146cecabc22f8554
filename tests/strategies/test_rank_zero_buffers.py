"""Buffers that change in training (BatchNorm running statistics) are rank 0's on every rank, as under ``ddp``.

``ddp`` broadcasts rank 0's buffers before each forward, and a checkpoint holds rank 0's. fairscale FSDP and FSDP2
kept each rank's own, so validation after a resume (every rank starting from rank 0's statistics) differed from the
uninterrupted run. ``ddp_sharded`` gets the semantics from ``ShardedDataParallel(broadcast_buffers=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.testing import make_dataset
from tests.support.helpers import RankRecorder, fit, new_model

STRATEGIES: dict[str, Any] = {
    "ddp_sharded": lambda **options: ShardedDDPStrategy(start_method="fork", **options),
    "fsdp_fairscale": lambda **options: FairScaleFSDPStrategy(start_method="fork", **options),
    "fsdp2": lambda **options: FSDP2Strategy(start_method="fork", **options),
}


class BatchNormModel(pl.LightningModule):
    """A linear layer, BatchNorm and a head; a constant buffer that never changes; validation loss logged per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.val_losses: list[float] = []

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.relu(self.norm(self.encoder(inputs)))) * self.scale
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        # Each rank's batches come from a different half with a different mean: their statistics differ.
        data = make_dataset(32)
        shifted = torch.cat([data.tensors[0][:16], data.tensors[0][16:] * 3 + 1])
        return DataLoader(TensorDataset(shifted, data.tensors[1]), batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(make_dataset(8, seed=99), batch_size=4)


class ValidationRecorder(pl.Callback):
    """Writes rank 0's ``val_loss`` of each epoch to ``<dir>/val.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.losses: dict[int, float] = {}

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.losses[trainer.current_epoch] = float(trainer.callback_metrics["val_loss"])
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "val.json").write_text(json.dumps(self.losses))

    def read(self) -> dict[int, float]:
        return {int(epoch): loss for epoch, loss in json.loads((self.directory / "val.json").read_text()).items()}


def _validation_losses(strategy: Any, directory: Path, ckpt_path: Path | None = None) -> dict[int, float]:
    pl.seed_everything(5, verbose=False)
    recorder = ValidationRecorder(directory)
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(strategy, BatchNormModel(), ckpt_path=ckpt_path, callbacks=[recorder, checkpoints], enable_checkpointing=True)
    return recorder.read()


def _running_means(trainer: pl.Trainer, module: pl.LightningModule) -> list[float]:
    return [float(value) for value in module.get_buffer("norm.running_mean")]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_validation_after_a_resume_equals_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    uninterrupted = _validation_losses(STRATEGIES[name](), tmp_path / "whole")
    resumed = _validation_losses(STRATEGIES[name](), tmp_path / "resumed", tmp_path / "whole" / "epoch=0.ckpt")
    under_ddp = _validation_losses("ddp_fork", tmp_path / "ddp")

    assert resumed[1] == pytest.approx(uninterrupted[1], rel=1e-6)
    assert uninterrupted == pytest.approx(under_ddp, rel=1e-6)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_rank_validates_with_rank_zeros_running_statistics(tmp_path: Path, name: str) -> None:
    recorder = RankRecorder(tmp_path, "on_validation_epoch_end", _running_means)
    pl.seed_everything(5, verbose=False)
    fit(STRATEGIES[name](), BatchNormModel(), callbacks=[recorder], max_epochs=1)

    rank0, rank1 = recorder.read()
    assert rank0 == rank1


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_broadcast_buffers_false_keeps_each_ranks_own_statistics(tmp_path: Path, name: str) -> None:
    recorder = RankRecorder(tmp_path, "on_validation_epoch_end", _running_means)
    pl.seed_everything(5, verbose=False)
    fit(STRATEGIES[name](broadcast_buffers=False), BatchNormModel(), callbacks=[recorder], max_epochs=1)

    rank0, rank1 = recorder.read()
    assert rank0 != rank1


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_only_buffers_that_change_in_training_are_broadcast(tmp_path: Path, name: str) -> None:
    broadcast: list[list[str]] = []

    def record_broadcasts(trainer: pl.Trainer, module: pl.LightningModule) -> list[str]:
        slots = trainer.strategy._rank_zero_buffers._changing or []
        return sorted(f"{type(owner).__name__}.{name}" for owner, name in slots)

    recorder = RankRecorder(tmp_path, "on_train_end", record_broadcasts)
    pl.seed_everything(5, verbose=False)
    fit(STRATEGIES[name](), BatchNormModel(), callbacks=[recorder], max_epochs=1)
    broadcast = recorder.read()

    expected = ["BatchNorm1d.num_batches_tracked", "BatchNorm1d.running_mean", "BatchNorm1d.running_var"]
    assert broadcast == [expected, expected]  # the constant `scale` never travels


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_a_model_whose_buffers_never_change_broadcasts_nothing(tmp_path: Path, name: str) -> None:
    def changing(trainer: pl.Trainer, module: pl.LightningModule) -> int:
        return len(trainer.strategy._rank_zero_buffers._changing or [])

    recorder = RankRecorder(tmp_path, "on_train_end", changing)
    fit(STRATEGIES[name](), new_model(), callbacks=[recorder], max_epochs=1)  # its `output_scale` buffer is constant

    assert recorder.read() == [0, 0]
