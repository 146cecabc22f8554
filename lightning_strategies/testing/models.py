"""A small, deterministic LightningModule and data for checking strategies on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from .._lightning import pl, trainer_of

OptimizerName = Literal["adam", "sgd"]

FEATURES = 8
HIDDEN = 16
OUTPUTS = 4


def make_dataset(samples: int = 64, seed: int = 1234) -> TensorDataset:
    """A fixed regression data set: the same tensors for the same ``samples`` and ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    targets = torch.randn(samples, OUTPUTS, generator=generator)
    return TensorDataset(inputs, targets)


def probe_input() -> Tensor:
    """The fixed input on which every rank records the model's output at validation time."""
    return torch.linspace(-1.0, 1.0, 3 * FEATURES).reshape(3, FEATURES)


class ConformanceModel(pl.LightningModule):
    """Two linear layers with separate param groups, a buffer, an LR scheduler and optional recording.

    Args:
        optimizer: ``"adam"`` or ``"sgd"`` (SGD with momentum).
        batch_size: Batch size of every data loader.
        samples: Number of training samples.
        record_dir: Where each rank writes what the conformance kit checks (probe outputs, identity checks);
            ``None`` records nothing.
    """

    def __init__(
        self,
        optimizer: OptimizerName = "adam",
        batch_size: int = 4,
        samples: int = 64,
        record_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["record_dir"])
        self.encoder = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.register_buffer("output_scale", torch.full((OUTPUTS,), 0.5))
        self.optimizer_name = optimizer
        self.batch_size = batch_size
        self.samples = samples
        self.record_dir = record_dir
        self.identity_failures: list[str] = []
        self.train_losses: list[float] = []
        self.predictions: list[Tensor] = []

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.tanh(self.encoder(inputs))) * self.output_scale
        return output

    def _check_identity(self, hook: str) -> None:
        trainer = trainer_of(self)
        if trainer is None:  # used as a plain module, e.g. to build a reference optimizer
            return
        strategy = trainer.strategy
        if strategy.lightning_module is not self:
            self.identity_failures.append(
                f"rank {self.global_rank}, {hook}: strategy.lightning_module is"
                f" {type(strategy.lightning_module).__name__} object {id(strategy.lightning_module):#x},"
                f" not the module passed to the Trainer ({id(self):#x})"
            )

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self._check_identity("training_step")
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        self.train_losses.append(float(loss.detach()))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self._check_identity("validation_step")
        inputs, targets, probes = batch
        if batch_idx == 0 and self.record_dir is not None and not self.trainer.sanity_checking:
            # Runs inside the wrapper's forward, on an input that went through it like any batch (so a wrapper that
            # casts inputs casts it too): what this rank's model computes, however it is sharded.
            output = self(probes[0]).detach().float().cpu()
            torch.save(output, Path(self.record_dir) / f"probe-epoch{self.current_epoch}-rank{self.global_rank}.pt")
        loss = nn.functional.mse_loss(self(inputs), targets)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self._check_identity("test_step")
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self._check_identity("predict_step")
        output: Tensor = self(batch[0])
        self.predictions.append(output.detach().float().cpu())
        return output

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_identity("on_save_checkpoint")

    def on_fit_end(self) -> None:
        self._write_record("fit")

    def on_validation_end(self) -> None:
        self._check_identity("on_validation_end")

    def on_test_end(self) -> None:
        self._write_record("test")

    def on_predict_end(self) -> None:
        self._write_record("predict")
        if self.record_dir is not None and self.predictions:
            path = Path(self.record_dir) / f"predictions-rank{self.global_rank}.pt"
            torch.save(torch.cat(self.predictions), path)

    def _write_record(self, stage: str) -> None:
        if self.record_dir is None:
            return
        record = {"identity_failures": self.identity_failures, "train_losses": self.train_losses}
        path = Path(self.record_dir) / f"record-{stage}-rank{self.global_rank}.json"
        path.write_text(json.dumps(record))

    def configure_optimizers(self) -> Any:
        self._check_identity("configure_optimizers")
        groups = [
            {"params": self.encoder.parameters(), "lr": 0.02},
            {"params": self.head.parameters(), "lr": 0.01},
        ]
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=0.02, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(groups, lr=0.02)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(make_dataset(self.samples), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader[Any]:
        data = make_dataset(2 * self.batch_size, seed=99)
        probes = probe_input().expand(len(data), -1, -1).clone()  # every sample carries the probe
        return DataLoader(TensorDataset(*data.tensors, probes), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(make_dataset(2 * self.batch_size, seed=98), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(make_dataset(2 * self.batch_size, seed=97), batch_size=self.batch_size)
