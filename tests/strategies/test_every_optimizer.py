"""Every torch.optim optimizer, and a user's own, under every sharded strategy: exact against ddp, or refused.

Each optimizer a strategy supports trains under it for an epoch and is saved; the next strategy of its chain restores
that checkpoint exactly and trains the next epoch; the last checkpoint equals ddp's after as many epochs (weights and
optimizer state, 1e-6). Each one a strategy cannot step exactly is refused at fit start, on every rank, with a
message naming why and where it works. docs/recipes.md ("Optimizers") states this table.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.strategies.optimizers import OptimizerNeed
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.support.helpers import assert_same_checkpoint_state, fit, new_model

Groups = list[dict[str, Any]]


class ScaledMomentum(torch.optim.Optimizer):
    """A user's optimizer: constructor arguments that are not hyper-parameters, attributes set in ``__init__``."""

    def __init__(self, params: Any, lr: float, momentum: float, *, scale: float, label: str) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.scale = scale
        self.label = label

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(param.grad, alpha=self.scale)
                param.add_(buffer, alpha=-group["lr"])
        return loss


def _two_groups(module: ConformanceModel) -> Groups:
    return [
        {"params": list(module.encoder.parameters()), "lr": 0.02},
        {"params": list(module.head.parameters()), "lr": 0.01},
    ]


def _matrices(module: ConformanceModel) -> Groups:  # Muon steps 2-D parameters only
    return [{"params": [module.encoder.weight], "lr": 0.02}, {"params": [module.head.weight], "lr": 0.01}]


#: Each optimizer of torch.optim (and the user's), built over the ConformanceModel's two param groups.
OPTIMIZERS: dict[str, Callable[[ConformanceModel], torch.optim.Optimizer]] = {
    "SGD": lambda m: torch.optim.SGD(_two_groups(m), lr=0.02, momentum=0.9, nesterov=True),
    "Adam": lambda m: torch.optim.Adam(_two_groups(m), lr=0.02, amsgrad=True),
    "AdamW": lambda m: torch.optim.AdamW(_two_groups(m), lr=0.02, weight_decay=0.05),
    "Adagrad": lambda m: torch.optim.Adagrad(_two_groups(m), lr=0.05, initial_accumulator_value=0.1),
    "Adadelta": lambda m: torch.optim.Adadelta(_two_groups(m), lr=1.0),
    "Adamax": lambda m: torch.optim.Adamax(_two_groups(m), lr=0.02),
    "ASGD": lambda m: torch.optim.ASGD(_two_groups(m), lr=0.02, t0=4),
    "NAdam": lambda m: torch.optim.NAdam(_two_groups(m), lr=0.02),
    "RAdam": lambda m: torch.optim.RAdam(_two_groups(m), lr=0.02),
    "RMSprop": lambda m: torch.optim.RMSprop(_two_groups(m), lr=0.01, momentum=0.5, centered=True),
    "Rprop": lambda m: torch.optim.Rprop(_two_groups(m), lr=0.01),
    "Adafactor": lambda m: torch.optim.Adafactor(_two_groups(m), lr=0.02),
    "Muon": lambda m: torch.optim.Muon(_matrices(m), lr=0.02),
    "LBFGS": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=3),
    "ScaledMomentum": lambda m: ScaledMomentum(_two_groups(m), lr=0.02, momentum=0.9, scale=0.5, label="mine"),
}


class EveryOptimizerModel(ConformanceModel):
    """The ConformanceModel (two param groups, a step-wise StepLR) with any optimizer of :data:`OPTIMIZERS`."""

    def __init__(self, optimizer: str = "SGD", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.torch_optimizer = optimizer

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.torch_optimizer](self)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


STRATEGIES = ("ddp_sharded_fork", "fsdp_fairscale_fork", "fsdp2_fork")
ELEMENT_WISE = (
    *("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"),
    "ScaledMomentum",
)
#: Where each optimizer works (the rest refuse it): element-wise ones everywhere.
WORKS_UNDER: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(ELEMENT_WISE, STRATEGIES),
    "Adafactor": ("ddp_sharded_fork",),
    "Muon": ("ddp_sharded_fork",),
    "LBFGS": (),
}
#: The message each refusal gives: what the optimizer's math needs, what the strategy does, and the fix.
REFUSALS: dict[tuple[str, str], str] = {
    **{
        (name, strategy): rf"{strategy.removesuffix('_fork')} cannot train optimizer 0 \({name}\) exactly: it"
        r" .*whole (parameter|matrix).*Use ddp_sharded \(OSS steps whole parameters\) or ddp"
        for name in ("Adafactor", "Muon")
        for strategy in ("fsdp_fairscale_fork", "fsdp2_fork")
    },
    **{
        ("LBFGS", strategy): rf"{strategy.removesuffix('_fork')} cannot train optimizer 0 \(LBFGS\) exactly: it treats"
        r" all parameters as one vector and calls the closure a data-dependent number of times.*Use ddp"
        for strategy in STRATEGIES
    },
}
#: The strategies each supported optimizer trains under, one epoch each, each resuming the previous one's checkpoint.
CHAINS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(ELEMENT_WISE, ("ddp_sharded_fork", "fsdp2_fork", "fsdp_fairscale_fork")),
    "Adafactor": ("ddp_sharded_fork", "ddp_fork"),
    "Muon": ("ddp_sharded_fork", "ddp_fork"),
}


def _train_epochs(strategy: str, directory: Path, name: str, epochs: int, resume: Path | None = None) -> Path:
    """Trains to the end of epoch ``epochs - 1`` (from ``resume``) and returns the checkpoint written there.

    A run that resumes also saves right after the restore, before its first step, into ``directory/restored.ckpt``.
    """
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)]
    if resume is not None:
        callbacks.append(SaveAfterRestore(directory / "restored.ckpt"))
    model = new_model(name, cls=EveryOptimizerModel)  # one seed for every run: it is not in the checkpoint
    fit(strategy, model, ckpt_path=resume, callbacks=callbacks, max_epochs=epochs, enable_checkpointing=True)
    return directory / f"epoch={epochs - 1}.ckpt"


@pytest.mark.parametrize("name", list(CHAINS))
def test_an_optimizer_trains_under_each_strategy_in_turn_and_ends_as_under_ddp(tmp_path: Path, name: str) -> None:
    """Each strategy trains an epoch and saves; the next one restores that exactly; the end equals ddp's."""
    chain = CHAINS[name]
    checkpoint: Path | None = None
    for epoch, strategy in enumerate(chain):
        directory = tmp_path / f"{epoch}-{strategy}"
        saved = _train_epochs(strategy, directory, name, epoch + 1, resume=checkpoint)
        if checkpoint is not None:
            assert_same_checkpoint_state(checkpoint, directory / "restored.ckpt")
        checkpoint = saved
    assert checkpoint is not None
    ddp = _train_epochs("ddp_fork", tmp_path / "ddp", name, len(chain))
    assert_same_checkpoint_state(ddp, checkpoint, atol=1e-6)


def test_every_supported_combination_is_trained() -> None:
    for name, strategies in WORKS_UNDER.items():
        assert set(strategies) <= set(CHAINS.get(name, ())), name


def _bounded(strategy: str) -> pl.strategies.Strategy:
    """The strategy with a 20 s collective timeout: a refusal that came after a hang would time out instead."""
    kinds: dict[str, Any] = {
        "ddp_sharded_fork": ShardedDDPStrategy,
        "fsdp_fairscale_fork": FairScaleFSDPStrategy,
        "fsdp2_fork": FSDP2Strategy,
    }
    created: pl.strategies.Strategy = kinds[strategy](start_method="fork", timeout=timedelta(seconds=20))
    return created


@pytest.mark.parametrize(("name", "strategy"), list(REFUSALS), ids=[f"{n}-{s}" for n, s in REFUSALS])
def test_an_optimizer_the_strategy_cannot_step_exactly_is_refused_at_fit_start(name: str, strategy: str) -> None:
    started = time.monotonic()
    with pytest.raises(Exception, match=REFUSALS[name, strategy]):
        fit(_bounded(strategy), new_model(name, cls=EveryOptimizerModel), max_epochs=1)
    assert time.monotonic() - started < 20  # before any collective could wait for a rank that decided otherwise


def test_every_combination_is_either_supported_or_refused() -> None:
    for name in OPTIMIZERS:
        for strategy in STRATEGIES:
            assert (strategy in WORKS_UNDER[name]) != ((name, strategy) in REFUSALS), (name, strategy)


def test_every_torch_optimizer_is_covered() -> None:
    torch_optimizers = {
        name
        for name, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    }
    assert torch_optimizers - set(OPTIMIZERS) == {"SparseAdam"}  # needs sparse gradients: its own tests below


class RowScaledSGD(torch.optim.SGD):
    """A user's optimizer whose math depends on each parameter's shape, declared as such."""

    sharding_need = (OptimizerNeed.WHOLE_PARAMETERS, "scales each matrix's rows by their norms")


class RowScaledModel(EveryOptimizerModel):
    def configure_optimizers(self) -> Any:
        return RowScaledSGD(self.parameters(), lr=0.02)


@pytest.mark.parametrize("strategy", ["fsdp_fairscale_fork", "fsdp2_fork"])
def test_a_users_optimizer_declaring_it_needs_whole_parameters_is_refused(strategy: str) -> None:
    with pytest.raises(Exception, match=r"optimizer 0 \(RowScaledSGD\) exactly: it scales each matrix's rows by their"):
        fit(_bounded(strategy), new_model(cls=RowScaledModel), max_epochs=1)


# ---------------------------------------------------------------------------- sparse gradients


class SparseEmbeddingModel(pl.LightningModule):
    """An embedding with sparse gradients, stepped by SparseAdam (or by SGD, which takes sparse gradients too)."""

    def __init__(self, optimizer: str = "SparseAdam") -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 4, sparse=True)
        self.optimizer_name = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        indices, targets = batch
        return torch.nn.functional.mse_loss(self.embedding(indices).sum(1), targets)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "SGD":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.SparseAdam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        indices = torch.randint(0, 32, (32, 3), generator=generator)
        data = TensorDataset(indices, torch.randn(32, 4, generator=generator))
        return DataLoader(data, batch_size=4)


def test_sparse_adam_trains_under_ddp() -> None:
    pl.seed_everything(3, verbose=False)
    model = SparseEmbeddingModel()
    before = model.embedding.weight.detach().clone()
    fit("ddp_fork", model, max_epochs=1)
    assert not torch.equal(model.embedding.weight, before)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_adam_is_refused_by_every_sharded_strategy(strategy: str) -> None:
    with pytest.raises(Exception, match=r"optimizer 0 \(SparseAdam\) exactly: it steps sparse gradients only.*Use ddp"):
        fit(_bounded(strategy), SparseEmbeddingModel(), max_epochs=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sparse_embedding_is_refused_by_every_sharded_strategy(strategy: str) -> None:
    with pytest.raises(Exception, match=r"cannot train embedding: sparse=True gives sparse gradients.*sparse=False"):
        fit(_bounded(strategy), SparseEmbeddingModel("SGD"), max_epochs=1)


def test_the_recipes_page_states_this_table() -> None:
    page = (Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    section = page.split("## Optimizers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(("| `", "| your own"))]
    stated: dict[str, tuple[str, ...]] = {}
    for row in rows:
        first, *cells = (cell.strip() for cell in row.strip("|").split("|"))
        names = ["ScaledMomentum"] if first.startswith("your own") else re.findall(r"`(\w+)`", first.split("(")[0])
        # The page's columns are STRATEGIES, in that order.
        works = tuple(strategy for strategy, cell in zip(STRATEGIES, cells, strict=True) if cell.startswith("works"))
        stated.update(dict.fromkeys(names, works))
    assert stated == {**WORKS_UNDER, "SparseAdam": ()}
