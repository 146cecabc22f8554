"""ShardedDDPStrategy: fairscale ShardedDataParallel + OSS on 2 CPU processes (fork launcher unless stated)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from pytorch_lightning.strategies import StrategyRegistry

from lightning_strategies import ShardedDDPStrategy
from lightning_strategies.testing import ConformanceModel, make_dataset
from tests.support.helpers import (
    RankRecorder,
    assert_resume_continues_the_run,
    assert_resume_restores_exactly,
    assert_same_weights,
    fit,
    new_model,
    train_and_save,
)

# ---------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("name", "start_method"), [("ddp_sharded", "popen"), ("ddp_sharded_spawn", "spawn"), ("ddp_sharded_fork", "fork")]
)
def test_importing_the_package_registers_each_name(name: str, start_method: str) -> None:
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, ShardedDDPStrategy)
    assert strategy._start_method == start_method


def test_an_unknown_keyword_argument_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"bucket_size.*It takes: .*broadcast_buffers.*reduce_buffer_size"):
        ShardedDDPStrategy(bucket_size=5)


def test_find_unused_parameters_is_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match=r"reduces the gradients of unused parameters by itself"):
        ShardedDDPStrategy(find_unused_parameters=True)


def test_the_wrapper_holds_the_lightning_module_directly_and_gets_the_keyword_arguments(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        wrapper = trainer.strategy.model
        return {
            "wrapper": type(wrapper).__name__,
            "wraps_module_directly": isinstance(wrapper, ShardedDataParallel) and wrapper.module is module,
            "broadcast_buffers": getattr(wrapper, "_enable_broadcast_buffers", None),
        }

    recorder = RankRecorder(tmp_path, "on_train_start", probe)
    fit(
        ShardedDDPStrategy(start_method="fork", broadcast_buffers=False),
        new_model(),
        callbacks=[recorder],
        max_epochs=1,
    )

    for record in recorder.read():
        assert record == {"wrapper": "ShardedDataParallel", "wraps_module_directly": True, "broadcast_buffers": False}


def test_optimizers_become_oss_keeping_type_param_groups_defaults_and_schedulers(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        return {
            "type": type(optimizer).__name__,
            "shard_type": type(getattr(optimizer, "optim", None)).__name__,
            "group_lrs": [group["lr"] for group in optimizer.param_groups],
            "group_sizes": [len(group["params"]) for group in optimizer.param_groups],
            "defaults_lr": optimizer.defaults.get("lr"),
            "scheduler_drives_it": scheduler.optimizer is optimizer,
        }

    recorder = RankRecorder(tmp_path, "on_train_start", probe)
    fit("ddp_sharded_fork", new_model(), callbacks=[recorder], max_epochs=1)

    for record in recorder.read():
        assert record == {
            "type": "OSS",
            "shard_type": "Adam",
            "group_lrs": [0.02, 0.01],
            "group_sizes": [2, 2],
            "defaults_lr": 0.02,
            "scheduler_drives_it": True,
        }


def test_the_lr_scheduler_steps_the_learning_rate_of_every_shard(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        return {
            "visible": [group["lr"] for group in optimizer.param_groups],
            "used_by_shard": [group["lr"] for group in optimizer.optim.param_groups],
        }

    recorder = RankRecorder(tmp_path, "on_train_batch_end", probe)
    fit("ddp_sharded_fork", new_model(), callbacks=[recorder], max_epochs=1, limit_train_batches=4)

    # StepLR(step_size=3, gamma=0.5) per step: halved after step 3, so step 4 ran on the shard with the halved rate.
    for record in recorder.read():
        assert record["visible"] == [0.01, 0.005]
        assert record["used_by_shard"] == [0.01, 0.005]


class WarningRecorder(pl.Callback):
    """Collects the warnings raised during training on each rank into ``<dir>/warnings-rank<r>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.catcher: Any = None
        self.caught: list[warnings.WarningMessage] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.catcher.__exit__(None, None, None)
        messages = [str(warning.message) for warning in self.caught]
        (self.directory / f"warnings-rank{trainer.global_rank}.json").write_text(json.dumps(messages))


def test_the_lr_scheduler_does_not_warn_that_the_optimizer_step_was_replaced(tmp_path: Path) -> None:
    fit("ddp_sharded_fork", new_model(), callbacks=[WarningRecorder(tmp_path)], max_epochs=1, limit_train_batches=4)

    for rank in range(2):
        messages = json.loads((tmp_path / f"warnings-rank{rank}.json").read_text())
        assert not [message for message in messages if "lr_scheduler" in message or "optimizer.step()" in message]


# ---------------------------------------------------------------------------------------------- training math


def _fit_pair(
    optimizer: str = "adam",
    cls: type[ConformanceModel] = ConformanceModel,
    sharded: Any = "ddp_sharded_fork",
    **overrides: Any,
) -> tuple[pl.LightningModule, pl.LightningModule]:
    reference = new_model(optimizer, cls=cls)
    fit("ddp_fork", reference, **overrides)
    model = new_model(optimizer, cls=cls)
    fit(sharded, model, **overrides)
    return reference, model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_with_validation_between_epochs_matches_upstream_ddp(optimizer: str) -> None:
    # Validation puts the wrapper into eval mode; fairscale stops reducing gradients unless train mode comes back.
    reference, model = _fit_pair(optimizer, max_epochs=3)
    assert_same_weights(reference, model)


def test_training_with_gradient_buckets_matches_upstream_ddp() -> None:
    # Buckets need gradients zeroed in place; torch 2's set_to_none default would make them reduce stale values.
    reference, model = _fit_pair(sharded=ShardedDDPStrategy(start_method="fork", reduce_buffer_size=2**20))
    assert_same_weights(reference, model)


def test_gradient_accumulation_matches_upstream_ddp() -> None:
    reference, model = _fit_pair("sgd", accumulate_grad_batches=3)
    assert_same_weights(reference, model)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_upstream_ddp(algorithm: str) -> None:
    # A small limit so that clipping changes every step; by norm needs the norm over all ranks' shards.
    reference, model = _fit_pair("sgd", gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    assert_same_weights(reference, model)


class ManualModel(ConformanceModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self(inputs), targets)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_matches_upstream_ddp() -> None:
    reference, model = _fit_pair("sgd", cls=ManualModel)
    assert_same_weights(reference, model)


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_optimizer_state_is_consolidated_on_rank_0_only(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        state = trainer.strategy.optimizer_state(trainer.optimizers[0])
        model_state = trainer.strategy.lightning_module_state_dict()
        return {"optimizer_params_with_state": sorted(state.get("state", {})), "model_keys": len(model_state)}

    recorder = RankRecorder(tmp_path, "on_train_end", probe)
    fit("ddp_sharded_fork", new_model(), callbacks=[recorder], max_epochs=1)

    rank0, rank1 = recorder.read()
    assert rank0 == {"optimizer_params_with_state": [0, 1, 2, 3], "model_keys": 5}
    assert rank1 == {"optimizer_params_with_state": [], "model_keys": 0}


PAIRS = [("ddp_sharded_fork", "ddp_sharded_fork"), ("ddp_sharded_fork", "ddp_fork"), ("ddp_fork", "ddp_sharded_fork")]


@pytest.mark.parametrize(("saved_by", "resumed_by"), PAIRS)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resuming_restores_model_and_optimizer_state_exactly(
    tmp_path: Path, saved_by: str, resumed_by: str, optimizer: str
) -> None:
    assert_resume_restores_exactly(tmp_path, saved_by, resumed_by, optimizer)


@pytest.mark.parametrize(("saved_by", "resumed_by"), PAIRS[1:])
def test_interrupting_and_resuming_with_another_strategy_equals_an_uninterrupted_run(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    assert_resume_continues_the_run(tmp_path, saved_by, resumed_by, atol=1e-6)


def test_checkpoints_carry_the_metadata_block(tmp_path: Path) -> None:
    checkpoint = torch.load(train_and_save("ddp_sharded_fork", tmp_path), weights_only=True)
    assert checkpoint["lightning_strategies"] == {
        "format_version": 1,
        "strategy": "ddp_sharded",
        "world_size": 2,
        "state_dict_type": "full",
    }


# ---------------------------------------------------------------------------------------------- evaluation


def test_test_without_fit_computes_the_plain_modules_loss() -> None:
    model = new_model()
    trainer = pl.Trainer(
        strategy="ddp_sharded_fork", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
    )
    (result,) = trainer.test(model, verbose=False)

    data = make_dataset(8, seed=98)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(new_model()(data.tensors[0]), data.tensors[1])
    assert result["test_loss"] == pytest.approx(float(expected), abs=1e-6)


def test_validate_from_a_checkpoint_uses_its_weights(tmp_path: Path) -> None:
    saved = train_and_save("ddp_sharded_fork", tmp_path)
    trainer = pl.Trainer(
        strategy="ddp_sharded_fork", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
    )
    (result,) = trainer.validate(new_model(seed=11), ckpt_path=saved, verbose=False)

    trained = ConformanceModel.load_from_checkpoint(saved, weights_only=True)
    data = make_dataset(8, seed=99)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(trained(data.tensors[0]), data.tensors[1])
    assert result["val_loss"] == pytest.approx(float(expected), abs=1e-6)
