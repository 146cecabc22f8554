"""Small helpers shared by the distributed tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import Strategy

from lightning_strategies import ShardedDDPStrategy
from lightning_strategies.testing import ConformanceModel
from tests.conftest import trainer_kwargs


def new_model(
    optimizer: str = "adam", seed: int = 3, cls: type[ConformanceModel] = ConformanceModel, **kwargs: Any
) -> ConformanceModel:
    """A model with the same initial weights for the same seed."""
    pl.seed_everything(seed, verbose=False)
    return cls(optimizer=optimizer, **kwargs)  # type: ignore[arg-type]


def fit(
    strategy: Strategy | str,
    model: pl.LightningModule,
    *,
    ckpt_path: Path | None = None,
    callbacks: Iterable[pl.Callback] = (),
    **overrides: Any,
) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(**overrides))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def assert_same_weights(left: torch.nn.Module, right: torch.nn.Module, atol: float = 1e-6) -> None:
    left_state, right_state = left.state_dict(), right.state_dict()
    assert left_state.keys() == right_state.keys()
    for key, value in left_state.items():
        assert torch.allclose(value, right_state[key], atol=atol, rtol=0), (
            f"{key} differs by {(value - right_state[key]).abs().max()}"
        )


def train_and_save(strategy: Any, directory: Path, optimizer: str = "adam", **overrides: Any) -> Path:
    """Trains one epoch and returns the path of the checkpoint written at its end."""
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    overrides = {"max_epochs": 1, "enable_checkpointing": True, **overrides}
    fit(strategy, new_model(optimizer), callbacks=[checkpoints], **overrides)
    return directory / "epoch=0.ckpt"


def comparable_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": {index: dict(entries) for index, entries in state["state"].items()},
        "lrs": [group["lr"] for group in state["param_groups"]],
        "params": [group["params"] for group in state["param_groups"]],
    }


class RankRecorder(pl.Callback):
    """Runs ``probe(trainer, module)`` in one hook on every rank; writes the result to ``<dir>/<hook>-rank<r>.json``."""

    def __init__(self, directory: Path, hook: str, probe: Callable[[pl.Trainer, pl.LightningModule], Any]) -> None:
        self.directory = directory
        self.probe = probe
        setattr(self, hook, self._record)
        self.hook = hook

    def _record(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        result = self.probe(trainer, module)
        (self.directory / f"{self.hook}-rank{trainer.global_rank}.json").write_text(json.dumps(result))

    def read(self, world_size: int = 2) -> list[Any]:
        return [json.loads((self.directory / f"{self.hook}-rank{rank}.json").read_text()) for rank in range(world_size)]


class SaveOnTrainStart(pl.Callback):
    """Saves a checkpoint right after a resumed run restored its state, before any step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class GuardedShardedStrategy(ShardedDDPStrategy):
    """Records, on every rank, whether the weights after a refused restore equal the ones before it."""

    def __init__(self, directory: Path) -> None:
        super().__init__(start_method="fork")
        self.directory = directory

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.require_lightning_module()
        before = {key: value.clone() for key, value in module.state_dict().items()}
        try:
            super().load_model_state_dict(checkpoint, strict=strict)
        except Exception:
            unchanged = all(torch.equal(value, before[key]) for key, value in module.state_dict().items())
            (self.directory / f"unchanged-rank{self.global_rank}.json").write_text(json.dumps(unchanged))
            raise

    def read(self) -> list[bool]:
        return [json.loads(path.read_text()) for path in sorted(self.directory.glob("unchanged-rank*.json"))]
