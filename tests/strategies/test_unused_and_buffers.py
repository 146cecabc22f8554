"""Submodules no step calls and buffers that change in training behave as under upstream ``ddp`` (issue 27).

Compared with ``DDPStrategy(start_method="fork", find_unused_parameters=True)``: every rank's weights, rank 0's
buffers (what a ``ddp`` checkpoint holds; BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) and
the optimizer state at the end of training, within 1e-5. Each run trains 2 epochs of 2 steps; resumed runs train the
second epoch from the checkpoint the first wrote.

- A parameter that no rank's backward reaches has no gradient for the step, so no optimizer moves it or keeps state
  for it; fairscale's gradient buckets gave it a zero gradient (weight decay and momentum moved it, Adam kept state).
- fsdp2's sharded directories hold no optimizer state for such a parameter, and resume (torch's load template has
  state for every parameter, and the check refused the directory).
- fsdp2's sharded directories hold rank 0's buffers (DCP took each from whichever rank had written least).
- A sharded fsdp2 save before the first step leaves the optimizers without state (torch's state-dict API stepped
  them once to create it: Adam's step count ran one ahead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.cli.consolidate import consolidate_checkpoint
from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.testing.models import FEATURES, HIDDEN, OUTPUTS, make_dataset
from tests.support.helpers import SaveAtTrainEnd, assert_same_checkpoint_state, fit

ATOL = 1e-5
State = dict[str, dict[str, Tensor]]  # a rank's final "parameters" and "buffers", by name
BUCKETS = 2**23  # fairscale's own default reduce_buffer_size (this package's default is 0: no buckets)


class Recipe(pl.LightningModule):
    """BatchNorm over inputs whose statistics differ between the ranks, an encoder and a head, a submodule ``unused``
    that no step calls, and a non-persistent buffer that changes in training (an average of the inputs).

    Args:
        optimizer: ``"sgd"`` (momentum and weight decay), ``"adam"`` or ``"adamw"`` (weight decay).
        manual: Manual optimization (``manual_backward``, ``step``, ``zero_grad`` in the step).
        batch_norm: Whether the BatchNorm is there.
        uncalled: Whether the uncalled submodule is there.
    """

    def __init__(
        self,
        optimizer: str = "adam",
        manual: bool = False,
        batch_norm: bool = True,
        uncalled: bool = True,
    ) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(FEATURES) if batch_norm else nn.Identity()
        self.encoder = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.unused = nn.Linear(OUTPUTS, OUTPUTS) if uncalled else None
        self.register_buffer("input_mean", torch.zeros(FEATURES), persistent=False)
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual

    def forward(self, inputs: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.input_mean.mul_(0.5).add_(inputs.mean(0), alpha=0.5)
        output: Tensor = self.head(torch.relu(self.encoder(self.norm(inputs))))
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader[Any]:
        data = make_dataset(16)
        inputs = data.tensors[0].clone()
        inputs[1::2] = inputs[1::2] * 3 + 1  # the sampler gives rank 1 the odd samples: other statistics
        return DataLoader(TensorDataset(inputs, data.tensors[1]), batch_size=4)


class FinalState(pl.Callback):
    """Writes each rank's full parameters and all its buffers (non-persistent ones too) at the end of training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        gathered = strategy.full_parameters() if isinstance(strategy, DirectReferenceStrategy) else nullcontext()
        state: dict[str, dict[str, Tensor]] = {"parameters": {}, "buffers": {}}
        with gathered:
            for name, param in module.named_parameters():
                state["parameters"][name] = _full(param).detach().clone()
        for name, buffer in module.named_buffers():
            state["buffers"][name] = _full(buffer).detach().clone()
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.directory / f"rank{trainer.global_rank}.pt")

    def read(self) -> list[State]:
        return [torch.load(self.directory / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def _full(tensor: Tensor) -> Tensor:
    full: Tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full


def ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def seeded(**recipe: Any) -> Recipe:
    pl.seed_everything(3, verbose=False)
    return Recipe(**recipe)


def train(
    strategy: Any,
    directory: Path,
    *,
    epochs: int = 2,
    ckpt_path: Path | None = None,
    trainer_options: dict[str, Any] | None = None,
    **recipe: Any,
) -> list[State]:
    """Trains ``epochs`` epochs, with a checkpoint after each (``epoch=<n>.ckpt``) and one at the end (``end.ckpt``);
    returns each rank's final state."""
    final = FinalState(directory / "final")
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    callbacks = [final, checkpoints, SaveAtTrainEnd(directory / "end.ckpt")]
    options = {"enable_checkpointing": True, "max_epochs": epochs, **(trainer_options or {})}
    fit(strategy, seeded(**recipe), ckpt_path=ckpt_path, callbacks=callbacks, **options)
    return final.read()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., tuple[Path, list[State]]]]:
    """Trains a recipe under a strategy of ``STRATEGIES`` once per module (the ``ddp`` references and the saving runs
    that several tests read); returns the run's directory and final states."""
    runs: dict[str, tuple[Path, list[State]]] = {}

    def run(
        strategy: str, epochs: int = 2, trainer_options: dict[str, Any] | None = None, **recipe: Any
    ) -> tuple[Path, list[State]]:
        key = repr((strategy, epochs, sorted({**recipe, **(trainer_options or {})}.items())))
        if key not in runs:
            directory = tmp_path_factory.mktemp(strategy)
            states = train(STRATEGIES[strategy](), directory, epochs=epochs, trainer_options=trainer_options, **recipe)
            runs[key] = directory, states
        return runs[key]

    yield run


def assert_trains_like_ddp(got: list[State], expected: list[State], buffers: list[str]) -> None:
    """Every rank's parameters and rank 0's ``buffers`` equal ``ddp``'s within ATOL.

    Other ranks' buffers are not compared: ``ddp`` broadcasts rank 0's before a forward only when the previous forward
    synchronised gradients, so under gradient accumulation and manual optimization rank 1's differ even between
    ``ddp``'s own uninterrupted and resumed runs (no checkpoint holds them).
    """
    for rank, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine["parameters"].keys() == theirs["parameters"].keys()
        pairs = [(mine["parameters"][name], theirs["parameters"][name], name) for name in theirs["parameters"]]
        if rank == 0:
            pairs += [(mine["buffers"][name], theirs["buffers"][name], name) for name in buffers]
        differences = {name: float((left.double() - right.double()).abs().max()) for left, right, name in pairs}
        assert max(differences.values()) <= ATOL, f"rank {rank}: {differences}"


PERSISTENT_BUFFERS = ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]


STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": ddp,
    "fsdp2": lambda: FSDP2Strategy(start_method="fork"),
    "fsdp2_sharded": lambda: FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
    "ddp_sharded": lambda: ShardedDDPStrategy(start_method="fork"),
    "ddp_sharded_buckets": lambda: ShardedDDPStrategy(start_method="fork", reduce_buffer_size=BUCKETS),
    "fsdp_fairscale": lambda: FairScaleFSDPStrategy(start_method="fork"),
}


def _resume(reader: str, checkpoint: Path, directory: Path, **recipe: Any) -> tuple[list[State], Path]:
    """Resumes ``checkpoint`` under ``reader`` (``"consolidated"``: the ``consolidate`` command's file, under
    ``ddp``); returns the final states and the end-of-training checkpoint."""
    if reader == "consolidated":
        consolidate_checkpoint(checkpoint, directory / "consolidated.ckpt", show_progress=False)
        checkpoint, reader = directory / "consolidated.ckpt", "ddp"
    states = train(STRATEGIES[reader](), directory / "resumed", ckpt_path=checkpoint, **recipe)
    return states, directory / "resumed" / "end.ckpt"


# ---------------------------------------------------------------------------------------------- fsdp2's checkpoints


@pytest.mark.parametrize(
    ("saver", "reader"),
    [
        ("fsdp2_sharded", "fsdp2_sharded"),
        ("fsdp2_sharded", "ddp_sharded"),
        ("fsdp2_sharded", "fsdp_fairscale"),
        ("fsdp2_sharded", "consolidated"),
        ("fsdp2", "fsdp2"),
    ],
)
def test_fsdp2_checkpoints_of_a_model_with_an_uncalled_submodule_resume_like_ddp(
    tmp_path: Path, trained: Any, saver: str, reader: str
) -> None:
    recipe = {"optimizer": "adam", "batch_norm": False}
    ddp_directory, expected = trained("ddp", **recipe)
    saved, _ = trained(saver, epochs=1, **recipe)

    got, end = _resume(reader, saved / "epoch=0.ckpt", tmp_path, **recipe)

    assert_trains_like_ddp(got, expected, buffers=[])
    if reader != "fsdp_fairscale":  # its flat parameters keep state for every parameter they hold
        # No optimizer state for the uncalled submodule, as under ddp: the states hold the same entries.
        assert_same_checkpoint_state(ddp_directory / "end.ckpt", end, atol=ATOL)


@pytest.mark.parametrize(
    ("saver", "reader"),
    [
        ("fsdp2_sharded", "fsdp2_sharded"),
        ("fsdp2_sharded", "ddp_sharded"),
        ("fsdp2_sharded", "fsdp_fairscale"),
        ("fsdp2", "fsdp2"),
    ],
)
def test_fsdp2_checkpoints_resume_with_rank_zeros_buffers_like_ddp(
    tmp_path: Path, trained: Any, saver: str, reader: str
) -> None:
    recipe = {"optimizer": "sgd", "uncalled": False}
    _, expected = trained("ddp", **recipe)
    saved, _ = trained(saver, epochs=1, **recipe)

    got, _ = _resume(reader, saved / "epoch=0.ckpt", tmp_path, **recipe)

    assert_trains_like_ddp(got, expected, buffers=PERSISTENT_BUFFERS)


class SaveAtTrainStart(pl.Callback):
    """Saves a checkpoint before the first step (the optimizers have no state yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def test_a_sharded_fsdp2_save_before_the_first_step_changes_no_training_and_resumes_like_ddp(
    tmp_path: Path, trained: Any
) -> None:
    recipe = {"optimizer": "adam", "batch_norm": False}
    _, expected = trained("ddp", **recipe)
    final = FinalState(tmp_path / "saving")
    model = seeded(**recipe)
    fit(STRATEGIES["fsdp2_sharded"](), model, callbacks=[SaveAtTrainStart(tmp_path / "start.ckpt"), final])

    resumed, _ = _resume("fsdp2_sharded", tmp_path / "start.ckpt", tmp_path, **recipe)

    assert_trains_like_ddp(final.read(), expected, buffers=[])  # Adam's step count did not run one ahead
    assert_trains_like_ddp(resumed, expected, buffers=[])


def test_fsdp2_trains_persistent_and_non_persistent_buffers_like_ddp(trained: Any) -> None:
    recipe = {"optimizer": "sgd", "uncalled": False}
    _, expected = trained("ddp", **recipe)

    _, got = trained("fsdp2", **recipe)

    assert_trains_like_ddp(got, expected, buffers=[*PERSISTENT_BUFFERS, "input_mean"])


# ---------------------------------------------------------------------------------------------- uncalled submodules


UNCALLED_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "ddp_sharded-buckets-sgd": ("ddp_sharded_buckets", {"optimizer": "sgd"}, {}),
    "ddp_sharded-buckets-adam": ("ddp_sharded_buckets", {"optimizer": "adam"}, {}),
    "ddp_sharded-buckets-adamw": ("ddp_sharded_buckets", {"optimizer": "adamw"}, {}),
    "ddp_sharded-buckets-sgd-accumulating": (
        "ddp_sharded_buckets",
        {"optimizer": "sgd"},
        {"accumulate_grad_batches": 2},
    ),
    "ddp_sharded-adamw-manual": ("ddp_sharded", {"optimizer": "adamw", "manual": True}, {}),
    "fsdp2-sgd-accumulating": ("fsdp2", {"optimizer": "sgd"}, {"accumulate_grad_batches": 2}),
    "fsdp2-adamw-manual": ("fsdp2", {"optimizer": "adamw", "manual": True}, {}),
}


@pytest.mark.parametrize("case", list(UNCALLED_CASES))
def test_a_submodule_no_step_calls_stays_and_has_no_optimizer_state_as_under_ddp(trained: Any, case: str) -> None:
    strategy, recipe, trainer_options = UNCALLED_CASES[case]
    recipe = {**recipe, "batch_norm": False}
    ddp_directory, expected = trained("ddp", trainer_options=trainer_options, **recipe)

    directory, got = trained(strategy, trainer_options=trainer_options, **recipe)

    assert_trains_like_ddp(got, expected, buffers=[])
    assert_same_checkpoint_state(ddp_directory / "end.ckpt", directory / "end.ckpt", atol=ATOL)
