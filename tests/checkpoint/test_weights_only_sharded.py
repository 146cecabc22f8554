"""Weights-only sharded checkpoints (``ModelCheckpoint(save_weights_only=True)`` with ``state_dict_type="sharded"``)
resume like weights-only files under every strategy: the weights and the training progress are restored, the
optimizers and LR schedulers start fresh, and one warning names what was not restored. ``consolidate`` turns them into
the weights-only file the same run writes with ``state_dict_type="full"``. A sharded checkpoint that holds optimizer
states for other optimizers is still refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.support.helpers import (
    STRATEGY_CLASSES,
    WarningRecorder,
    assert_same_tree,
    canonical_checkpoint,
    fit,
    new_model,
)

CLASSES = STRATEGY_CLASSES
SHARDED_WRITERS = ["fsdp_fairscale", "fsdp2"]
WARNING = "holds no optimizer state"


def strategy(name: str, state_dict_type: str = "sharded") -> Any:
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    return CLASSES[name](start_method="fork", **options)


def save_weights_only(name: str, directory: Path, state_dict_type: str = "sharded", weights_only: bool = True) -> Path:
    """One epoch of ``name`` with ``ModelCheckpoint(save_weights_only=...)``; the checkpoint at its end."""
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_weights_only=weights_only)
    fit(strategy(name, state_dict_type), new_model(), callbacks=[checkpoints], enable_checkpointing=True, max_epochs=1)
    return directory / "epoch=0.ckpt"


class TwoOptimizers(ConformanceModel):
    """The same module with one optimizer for the encoder and one for the head (manual optimization)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self(inputs), targets)
        optimizers = self.optimizers()
        assert isinstance(optimizers, list)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return loss

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.encoder.parameters(), lr=0.02), torch.optim.Adam(self.head.parameters(), lr=0.01)]


@pytest.mark.parametrize("resumed_by", list(CLASSES))
@pytest.mark.parametrize("saved_by", SHARDED_WRITERS)
def test_a_weights_only_sharded_checkpoint_resumes_weights_and_progress_with_one_warning(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    saved = save_weights_only(saved_by, tmp_path / "saved")
    recorder = WarningRecorder(tmp_path)
    restored = tmp_path / "restored.ckpt"
    fit(
        strategy(resumed_by, "full"),
        new_model(seed=11),
        ckpt_path=saved,
        callbacks=[recorder, SaveAfterRestore(restored)],
    )

    rank0, rank1 = ([message for message in messages if WARNING in message] for messages in recorder.read())
    assert len(rank0) == 1 and not rank1
    assert "Not restored: the state of the 1 optimizer(s); the state of LR scheduler(s) StepLR" in rank0[0]
    assert str(saved) in rank0[0]
    before, after = canonical_checkpoint(saved), torch.load(restored, weights_only=True)
    assert "optimizer_states" not in before  # the directory holds the weights only
    assert_same_tree(before["state_dict"], after["state_dict"])
    assert after["global_step"] == before["global_step"] == 8  # the training progress resumed
    assert after["optimizer_states"][0]["state"] == {}  # fresh: no step taken yet
    assert after["lr_schedulers"][0]["last_epoch"] == 0


@pytest.mark.parametrize("name", SHARDED_WRITERS)
def test_a_weights_only_sharded_checkpoint_resumes_under_other_optimizers(tmp_path: Path, name: str) -> None:
    saved = save_weights_only(name, tmp_path / "saved")
    resumed = TwoOptimizers()
    recorder = WarningRecorder(tmp_path)
    fit(strategy(name), resumed, ckpt_path=saved, callbacks=[recorder], max_epochs=2)

    assert any(WARNING in message for message in recorder.read()[0])


@pytest.mark.parametrize("name", SHARDED_WRITERS)
def test_a_sharded_checkpoint_with_optimizer_states_for_another_number_of_optimizers_is_refused(
    tmp_path: Path, name: str
) -> None:
    saved = save_weights_only(name, tmp_path / "saved", weights_only=False)
    with pytest.raises(Exception, match=r"holds 1 optimizer state\(s\), but configure_optimizers\(\) returned 2"):
        fit(strategy(name), TwoOptimizers(), ckpt_path=saved, max_epochs=2)


@pytest.mark.parametrize("name", SHARDED_WRITERS)
def test_consolidating_a_weights_only_directory_gives_the_weights_only_file_of_the_same_run(
    tmp_path: Path, name: str
) -> None:
    directory = save_weights_only(name, tmp_path / "sharded")
    full = save_weights_only(name, tmp_path / "full", state_dict_type="full")
    consolidated = tmp_path / "consolidated.ckpt"
    assert main(["consolidate", str(directory), str(consolidated)]) == 0

    expected, got = torch.load(full, weights_only=True), torch.load(consolidated, weights_only=True)
    assert got.keys() == expected.keys() and "optimizer_states" not in got
    assert_same_tree(expected["state_dict"], got["state_dict"])
    assert got["global_step"] == expected["global_step"]
