"""Recipes users write train under ``fsdp_fairscale`` as under upstream ``ddp`` (issue 27), or are refused at fit start.

Each recipe is compared with ``DDPStrategy(start_method="fork", find_unused_parameters=True)``: the weights within
1e-5 after one epoch of two steps on two processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy
from tests.helpers import assert_same_weights, fit


def ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def seeded(cls: type[pl.LightningModule], **kwargs: Any) -> pl.LightningModule:
    pl.seed_everything(3, verbose=False)
    return cls(**kwargs)


def gan_data() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    real, noise = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    return DataLoader(TensorDataset(real, noise), batch_size=4)


class ToggledGAN(pl.LightningModule):
    """The GAN of Lightning's manual-optimization docs, each update inside ``toggle_optimizer``/``untoggle_optimizer``.

    Args:
        discriminator_first: Step the discriminator before the generator.
        zero_grad_before_backward: ``opt.zero_grad()`` between the forward and ``manual_backward`` (the docs'
            placement), else after ``opt.step()``.
    """

    def __init__(self, discriminator_first: bool = True, zero_grad_before_backward: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.discriminator_first = discriminator_first
        self.zero_grad_before_backward = zero_grad_before_backward
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        real, noise = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        loss = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

        def discriminator_update() -> None:
            self.toggle_optimizer(discriminator_optimizer)
            fake = self.generator(noise)
            real_loss = loss(self.discriminator(real), ones)
            self._update(discriminator_optimizer, (real_loss + loss(self.discriminator(fake.detach()), zeros)) / 2)
            self.untoggle_optimizer(discriminator_optimizer)

        def generator_update() -> None:
            self.toggle_optimizer(generator_optimizer)
            self._update(generator_optimizer, loss(self.discriminator(self.generator(noise)), ones))
            self.untoggle_optimizer(generator_optimizer)

        updates = [discriminator_update, generator_update]
        for update in updates if self.discriminator_first else reversed(updates):
            update()

    def _update(self, optimizer: Any, loss: Tensor) -> None:
        if self.zero_grad_before_backward:
            optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        if not self.zero_grad_before_backward:
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return gan_data()


@pytest.mark.parametrize("discriminator_first", [True, False], ids=["discriminator-first", "generator-first"])
@pytest.mark.parametrize("zero_grad_before_backward", [True, False], ids=["zero-before-backward", "zero-after-step"])
def test_a_toggled_gan_trains_as_under_ddp_in_either_step_order(
    discriminator_first: bool, zero_grad_before_backward: bool
) -> None:
    # fairscale set the other network's gradient shard aside in each backward pass and never gave it back: zero_grad()
    # could not reach it, and that network's next gradient was added to the stale one.
    options = {"discriminator_first": discriminator_first, "zero_grad_before_backward": zero_grad_before_backward}
    reference, model = seeded(ToggledGAN, **options), seeded(ToggledGAN, **options)
    fit(ddp(), reference, max_epochs=1)
    fit(FairScaleFSDPStrategy(start_method="fork"), model, max_epochs=1)
    assert_same_weights(model, reference, atol=1e-5)
