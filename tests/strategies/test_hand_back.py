"""Complete checkpoints wherever they are written: in the main process after a fork/spawn fit (the hand-back), and
resumes from checkpoints that hold no optimizer state (one warning, the optimizer starts fresh)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies import ShardedDDPStrategy
from lightning_strategies.testing import SaveAfterRestore
from tests.support.helpers import (
    STRATEGY_CLASSES,
    LossRecorder,
    SaveAtTrainEnd,
    WarningRecorder,
    assert_same_tree,
    assert_same_weights,
    fit,
    new_model,
)

FORK = ["ddp_sharded_fork", "fsdp_fairscale_fork", "fsdp2_fork"]
SPAWN = ["ddp_sharded_spawn", "fsdp_fairscale_spawn", "fsdp2_spawn"]
CLASSES = STRATEGY_CLASSES
WARNING = "holds no optimizer state"


def family(strategy: str) -> str:
    return strategy.removesuffix("_fork").removesuffix("_spawn")


def load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def fit_then_save_in_main_process(strategy: Any, path: Path, **overrides: Any) -> Any:
    """One epoch with a fork/spawn launcher, then ``trainer.save_checkpoint(path)`` in this (the main) process."""
    trainer = fit(strategy, new_model(), max_epochs=1, **overrides)
    trainer.save_checkpoint(path)
    return trainer


@pytest.mark.parametrize("strategy", FORK + SPAWN)
def test_main_process_save_after_fit_equals_rank_zeros_save_at_the_end_of_fit(tmp_path: Path, strategy: str) -> None:
    at_train_end = tmp_path / "rank0-at-train-end.ckpt"
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{epoch}", monitor="train_loss")
    callbacks = [checkpoints, SaveAtTrainEnd(at_train_end)]
    trainer = fit_then_save_in_main_process(
        strategy, tmp_path / "main.ckpt", callbacks=callbacks, enable_checkpointing=True
    )

    main, rank0 = load(tmp_path / "main.ckpt"), load(at_train_end)
    assert_same_tree(rank0, main)
    if strategy in SPAWN:  # the one spawn fit per strategy: the main process's module holds what ddp trains
        reference = fit("ddp_fork", new_model(), max_epochs=1)
        assert_same_weights(reference.lightning_module, trainer.lightning_module, atol=1e-5)
    assert "state_dict" not in trainer.strategy.launcher.end_of_fit_state  # one copy of the weights: the module's
    # What upstream's main process loses, here equal to rank 0's: optimizer, scheduler, loop and callback state.
    assert sorted(main["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert main["lr_schedulers"][0]["last_epoch"] == main["global_step"] > 0
    assert main["callbacks"][checkpoints.state_key]["best_model_score"] is not None


@pytest.mark.parametrize("strategy", FORK)
def test_a_weights_only_save_in_the_main_process_gets_the_end_of_fit_counters_and_stays_weights_only(
    tmp_path: Path, strategy: str
) -> None:
    at_train_end = tmp_path / "rank0-at-train-end.ckpt"
    trainer = fit(strategy, new_model(), callbacks=[SaveAtTrainEnd(at_train_end, weights_only=True)], max_epochs=1)
    trainer.save_checkpoint(tmp_path / "main.ckpt", weights_only=True)

    main = load(tmp_path / "main.ckpt")
    assert_same_tree(load(at_train_end), main)
    assert "optimizer_states" not in main and main["global_step"] > 0


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [(a, b) for a in FORK for b in [*FORK, "ddp_fork"] if family(a) != family(b)],
)
def test_main_process_checkpoint_resumes_as_the_uninterrupted_run(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    uninterrupted = new_model()
    fit(saved_by, uninterrupted, callbacks=[LossRecorder(tmp_path / "whole")], max_epochs=2)
    saved = tmp_path / "main.ckpt"
    fit_then_save_in_main_process(saved_by, saved)
    resumed = new_model()  # the same seed: Lightning's samplers shuffle with it
    fit(resumed_by, resumed, ckpt_path=saved, callbacks=[LossRecorder(tmp_path / "resumed")], max_epochs=2)

    whole = json.loads((tmp_path / "whole" / "losses.json").read_text())
    after = json.loads((tmp_path / "resumed" / "losses.json").read_text())
    assert len(after) == len(whole) // 2, "the resume did not continue at the saved step"
    assert max(abs(a - b) for a, b in zip(after, whole[len(after) :], strict=True)) <= 1e-5  # the first one too
    assert_same_weights(uninterrupted, resumed, atol=1e-5)


@pytest.mark.parametrize(
    ("strategy", "options"),
    [(name, {"hand_back": "weights"}) for name in FORK]
    + [(name, {"state_dict_type": "sharded"}) for name in ("fsdp_fairscale_fork", "fsdp2_fork")],
)
def test_without_the_checkpoint_hand_back_only_the_weights_come_back(
    tmp_path: Path, strategy: str, options: dict[str, Any]
) -> None:
    reference = new_model()
    fit(strategy, reference, max_epochs=1)
    trainer = fit(CLASSES[family(strategy)](start_method="fork", **options), new_model(), max_epochs=1)

    assert trainer.strategy.launcher.end_of_fit_state is None
    assert_same_weights(reference, trainer.lightning_module)


@pytest.mark.parametrize("strategy", FORK)
def test_hand_back_weights_leaves_main_process_saves_without_optimizer_state(tmp_path: Path, strategy: str) -> None:
    weights_only = CLASSES[family(strategy)](start_method="fork", hand_back="weights")
    fit_then_save_in_main_process(weights_only, tmp_path / "main.ckpt")

    saved = load(tmp_path / "main.ckpt")
    assert saved["optimizer_states"] == [] and saved["lr_schedulers"] == []


def test_an_unknown_hand_back_is_refused_naming_the_options() -> None:
    with pytest.raises(ValueError, match="hand_back must be one of 'checkpoint', 'weights', got 'optimizer'"):
        ShardedDDPStrategy(start_method="fork", hand_back="optimizer")  # type: ignore[arg-type]


def save_without_optimizer_state(kind: str, strategy: str, directory: Path) -> Path:
    if kind == "save_weights_only":
        checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_weights_only=True)
        fit(strategy, new_model(), callbacks=[checkpoints], enable_checkpointing=True, max_epochs=1)
        return directory / "epoch=0.ckpt"
    # an empty optimizer_states list, as upstream's main process writes after a spawn fit
    path = directory / "main.ckpt"
    fit_then_save_in_main_process(CLASSES[family(strategy)](start_method="fork", hand_back="weights"), path)
    return path


@pytest.mark.parametrize("kind", ["save_weights_only", "empty_optimizer_states"])
@pytest.mark.parametrize("strategy", FORK)
def test_checkpoint_without_optimizer_state_resumes_weights_and_progress_with_one_warning(
    tmp_path: Path, strategy: str, kind: str
) -> None:
    saved = save_without_optimizer_state(kind, strategy, tmp_path / "saved")
    recorder = WarningRecorder(tmp_path)
    restored = tmp_path / "restored.ckpt"
    fit(strategy, new_model(seed=11), ckpt_path=saved, callbacks=[recorder, SaveAfterRestore(restored)])

    rank0, rank1 = ([message for message in messages if WARNING in message] for messages in recorder.read())
    assert len(rank0) == 1 and not rank1
    assert "Not restored: the state of the 1 optimizer(s); the state of LR scheduler(s) StepLR" in rank0[0]
    assert "The optimizer starts fresh" in rank0[0]
    before, after = load(saved), load(restored)
    assert_same_tree(before["state_dict"], after["state_dict"])
    assert after["global_step"] == before["global_step"]  # the training progress resumed, as the file holds it
    assert after["optimizer_states"][0]["state"] == {}  # fresh: no step taken yet
    assert after["lr_schedulers"][0]["last_epoch"] == 0
