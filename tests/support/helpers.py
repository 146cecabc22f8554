"""Small helpers shared by the distributed tests."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import Strategy
from torch.distributed.tensor import DTensor

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.optimizer_state import numbered_through_groups
from lightning_strategies.checkpoint.sharded import open_sharded, sharded_directory
from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.conftest import trainer_kwargs, write_json


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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # A module trained in this process by fsdp2 (one rank) keeps DTensor parameters: compare their full values.
    full: torch.Tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full


def assert_same_weights(left: torch.nn.Module, right: torch.nn.Module, atol: float = 1e-6) -> None:
    left_state, right_state = left.state_dict(), right.state_dict()
    assert left_state.keys() == right_state.keys()
    for key, value in left_state.items():
        value, other = _full(value), _full(right_state[key])
        assert torch.allclose(value, other, atol=atol, rtol=0), f"{key} differs by {(value - other).abs().max()}"


def train_and_save(
    strategy: Any,
    directory: Path,
    optimizer: str = "adam",
    cls: type[ConformanceModel] = ConformanceModel,
    **overrides: Any,
) -> Path:
    """Trains one epoch and returns the path of the checkpoint written at its end."""
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    overrides = {"max_epochs": 1, "enable_checkpointing": True, **overrides}
    fit(strategy, new_model(optimizer, cls=cls), callbacks=[checkpoints], **overrides)
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
        write_json(self.directory / f"{self.hook}-rank{trainer.global_rank}.json", result)

    def read(self, world_size: int = 2) -> list[Any]:
        return [json.loads((self.directory / f"{self.hook}-rank{rank}.json").read_text()) for rank in range(world_size)]


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
            write_json(self.directory / f"unchanged-rank{self.global_rank}.json", unchanged)
            raise

    def read(self) -> list[bool]:
        return [json.loads(path.read_text()) for path in sorted(self.directory.glob("unchanged-rank*.json"))]


def _local_weights(strategy: Strategy) -> list[torch.Tensor]:
    """This rank's own tensors of the (wrapped) model: flat shards, DTensor local shards, whole tensors, buffers."""
    module = strategy.model or strategy.lightning_module
    tensors = [*module.parameters(), *module.buffers()]
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    return [tensor.detach().clone() for tensor in local]


def guarded_strategy(cls: type[Strategy], directory: Path, **kwargs: Any) -> Strategy:
    """``cls(start_method="fork", **kwargs)`` that records, on each rank whose restore failed, whether that rank's
    weights (its shards) are bit-identical to the ones before the restore: ``<dir>/unchanged-rank<r>.json``."""

    class Guarded(cls):  # type: ignore[valid-type,misc]
        def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
            before = _local_weights(self)
            try:
                super().load_model_state_dict(checkpoint, strict=strict)
            except Exception:
                after = _local_weights(self)
                unchanged = len(before) == len(after) and all(map(torch.equal, before, after))
                write_json(directory / f"unchanged-rank{self.global_rank}.json", unchanged)
                raise

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{cls.__name__}"
    strategy: Strategy = Guarded(start_method="fork", **kwargs)
    return strategy


def unchanged_reports(directory: Path) -> list[bool]:
    """What :func:`guarded_strategy` recorded, one entry per rank that refused."""
    return [json.loads(path.read_text()) for path in sorted(directory.glob("unchanged-rank*.json"))]


def assert_resume_restores_exactly(
    tmp_path: Path,
    saved_by: Any,
    resumed_by: Any,
    optimizer: str = "adam",
    cls: type[ConformanceModel] = ConformanceModel,
    resumed_seed: int = 11,
    **overrides: Any,
) -> tuple[Path, Path]:
    """Saved by one strategy, restored by another, saved again before any step: model and optimizer state equal.

    ``overrides`` go to both Trainers (e.g. ``accelerator="gpu", devices=1``). The run's seed (``resumed_seed``) is
    not part of the checkpoint and changes the second epoch's losses. Returns the saved and the re-saved file.
    """
    saved = train_and_save(saved_by, tmp_path / "saved", optimizer, cls=cls, **overrides)
    restored = tmp_path / "restored.ckpt"
    resumed = new_model(optimizer, seed=resumed_seed, cls=cls)
    fit(resumed_by, resumed, ckpt_path=saved, callbacks=[SaveAfterRestore(restored)], **overrides)

    assert_same_checkpoint_state(saved, restored)
    return saved, restored


def canonical_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file as saved, or a sharded directory (ours or upstream's) consolidated to canonical state."""
    directory = sharded_directory(path)
    if directory is not None:
        return consolidate(open_sharded(directory)).checkpoint
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    # Numbered through the groups, as torch numbers them (upstream's full files number them in module order).
    loaded["optimizer_states"] = [numbered_through_groups(state) for state in loaded.get("optimizer_states", [])]
    return loaded


def assert_same_checkpoint_state(expected_path: Path, got_path: Path, atol: float = 0.0) -> None:
    """Two checkpoints hold the same model state, optimizer state and LR schedulers (exactly, by default).

    Either may be a sharded directory (compared consolidated). With ``atol`` > 0 the tensors may differ by that much
    (e.g. a strategy's checkpoint against ddp's after the same training); their keys, shapes, param groups and every
    value that is not a tensor are still equal.
    """

    def same(left: Any, right: Any) -> bool:
        if not isinstance(left, torch.Tensor | int | float) or not isinstance(right, torch.Tensor | int | float):
            return bool(left == right)  # a module's extra state, a scheduler's settings
        left, right = torch.as_tensor(left).cpu(), torch.as_tensor(right).cpu()  # ddp saves CUDA tensors as they are
        return left.shape == right.shape and bool(torch.allclose(left, right, atol=atol, rtol=0, equal_nan=True))

    before = canonical_checkpoint(expected_path)
    after = canonical_checkpoint(got_path)
    assert before["state_dict"].keys() == after["state_dict"].keys()
    for key, value in before["state_dict"].items():
        assert same(value, after["state_dict"][key]), key
    assert len(before["optimizer_states"]) == len(after["optimizer_states"])
    for saved_state, restored_state in zip(before["optimizer_states"], after["optimizer_states"], strict=True):
        expected = comparable_optimizer_state(saved_state)
        got = comparable_optimizer_state(restored_state)
        assert expected["lrs"] == got["lrs"] and expected["params"] == got["params"]
        assert expected["state"].keys() == got["state"].keys()
        for index, entries in expected["state"].items():
            assert entries.keys() == got["state"][index].keys()
            for name, value in entries.items():
                assert same(value, got["state"][index][name]), (index, name)
    assert after["lr_schedulers"] == before["lr_schedulers"]
    assert after["global_step"] == before["global_step"]


class LossRecorder(pl.Callback):
    """Writes rank 0's training losses to ``<dir>/losses.json`` at the end of training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json(self.directory / "losses.json", self.losses)


def assert_resume_continues_the_run(
    tmp_path: Path, saved_by: Any, resumed_by: Any, atol: float = 1e-5, **overrides: Any
) -> None:
    """Resuming with another strategy gives the uninterrupted run's losses (no spike) and final weights.

    ``overrides`` go to every Trainer (e.g. ``accelerator="gpu", devices=1``).
    """
    overrides = {"max_epochs": 2, **overrides}
    uninterrupted = new_model()
    fit(saved_by, uninterrupted, callbacks=[LossRecorder(tmp_path / "whole")], **overrides)
    saved = train_and_save(saved_by, tmp_path / "saved", **{**overrides, "max_epochs": 1})
    resumed = new_model()
    fit(resumed_by, resumed, ckpt_path=saved, callbacks=[LossRecorder(tmp_path / "resumed")], **overrides)

    whole = json.loads((tmp_path / "whole" / "losses.json").read_text())
    after = json.loads((tmp_path / "resumed" / "losses.json").read_text())
    assert after, "the resumed run trained no step"
    tail = whole[len(whole) - len(after) :]
    assert max(abs(a - b) for a, b in zip(after, tail, strict=True)) <= atol  # the first one included: no spike
    assert_same_weights(uninterrupted, resumed, atol=atol)


def assert_same_tree(left: Any, right: Any, where: str = "checkpoint") -> None:
    """Two nested containers (checkpoints) hold the same keys, values and exactly equal tensors."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        assert isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor), f"{where}: {left!r} vs {right!r}"
        assert left.dtype == right.dtype and torch.equal(left, right), f"{where}: tensors differ"
    elif isinstance(left, Mapping):
        assert isinstance(right, Mapping) and left.keys() == right.keys(), f"{where}: keys {list(left)} vs {right!r}"
        for key in left:
            assert_same_tree(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, list | tuple):
        assert type(left) is type(right) and len(left) == len(right), f"{where}: {left!r} vs {right!r}"
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same_tree(a, b, f"{where}[{index}]")
    else:
        assert left == right, f"{where}: {left!r} vs {right!r}"


class SaveAtTrainEnd(pl.Callback):
    """Saves a checkpoint on every rank at the very end of training (what a fit ends with)."""

    def __init__(self, path: Path, weights_only: bool = False) -> None:
        self.path = path
        self.weights_only = weights_only

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path, weights_only=self.weights_only)


class WarningRecorder(pl.Callback):
    """Records the warnings each rank raises from setup until training starts (restoring a checkpoint included) and
    writes their messages to ``<dir>/warnings-rank<r>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._catcher: Any = None
        self._records: list[Any] = []

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        messages = [str(record.message) for record in self._records]
        write_json(self.directory / f"warnings-rank{trainer.global_rank}.json", messages)

    def read(self, world_size: int = 2) -> list[list[str]]:
        return [json.loads((self.directory / f"warnings-rank{rank}.json").read_text()) for rank in range(world_size)]


#: Our strategies by registry name.
STRATEGY_CLASSES: dict[str, type[DirectReferenceStrategy]] = {
    "ddp_sharded": ShardedDDPStrategy,
    "fsdp_fairscale": FairScaleFSDPStrategy,
    "fsdp2": FSDP2Strategy,
}
#: Every (strategy, state_dict_type) a strategy saves: ddp_sharded writes full files only.
SAVE_FORMATS = [
    ("ddp_sharded", "full"),
    ("fsdp_fairscale", "full"),
    ("fsdp_fairscale", "sharded"),
    ("fsdp2", "full"),
    ("fsdp2", "sharded"),
]
