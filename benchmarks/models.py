"""The benchmark model and data: a plain MLP, the same for Lightning runs and hand-written loops."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LEARNING_RATE = 1e-3


class BenchModel(pl.LightningModule):
    """``depth`` square linear layers with ReLU between them, trained with MSE and Adam.

    Args:
        width: Features in and out of every layer.
        depth: Number of linear layers (parameter tensors: ``2 * depth``).
    """

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(depth):
            layers.append(nn.Linear(width, width))
            if index < depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return loss_of(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LEARNING_RATE)


def loss_of(output: Tensor, target: Tensor) -> Tensor:
    """The training loss, shared by Lightning's ``training_step`` and the hand-written loops."""
    return nn.functional.mse_loss(output, target)


def new_model(width: int, depth: int, seed: int = 7) -> BenchModel:
    """A model with the same initial weights on every rank and in every variant."""
    torch.manual_seed(seed)
    return BenchModel(width, depth)


def parameter_count(width: int, depth: int) -> int:
    """Parameters of ``BenchModel(width, depth)``."""
    return depth * (width * width + width)


def depth_for(params: int, width: int) -> int:
    """The depth whose model has about ``params`` parameters at ``width``."""
    return max(1, round(params / parameter_count(width, 1)))


def dataset(width: int, samples: int, seed: int = 11) -> TensorDataset:
    """Random inputs and targets, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, width, generator=generator), torch.randn(samples, width, generator=generator)
    )


def lightning_loader(data: TensorDataset, batch_size: int) -> DataLoader[Any]:
    """What a user passes to ``Trainer.fit``; Lightning adds the ``DistributedSampler``."""
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def hand_loader(data: TensorDataset, batch_size: int, rank: int, world_size: int) -> DataLoader[Any]:
    """The loader Lightning builds from :func:`lightning_loader`, written by hand."""
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)
