"""Ranks given different settings (strategy options, checkpoint paths) fail on every rank with a clear error.

Without the check they would pair up mismatched collectives and wait for the process-group timeout (30 minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_strategies import FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.strategies.base import DirectReferenceStrategy
from tests.support.helpers import fit, new_model, train_and_save

SCRIPT = Path(__file__).parents[1] / "scripts" / "fail_rank.py"
DISAGREE = "disagree on"


class RankOneOption(pl.Callback):
    """Gives rank 1's strategy another value for one option, as a rank-dependent config would (before wrapping)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank == 1:
            setattr(trainer.strategy, self.name, self.value)


class SaveToOwnPath(pl.Callback):
    """Calls trainer.save_checkpoint with a path that depends on the rank (a common bug: a rank-local tmp dir)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.directory / f"rank{trainer.global_rank}.ckpt")


@pytest.mark.parametrize(
    ("strategy", "option", "value"),
    [
        ("fsdp_fairscale_fork", "_state_dict_type", "sharded"),
        ("fsdp2_fork", "_reshard_after_forward", False),
        (
            ShardedDDPStrategy(start_method="fork", broadcast_buffers=True),
            "_sharded_ddp_kwargs",
            {"reduce_buffer_size": 0},
        ),
    ],
    ids=["fsdp_fairscale-state_dict_type", "fsdp2-reshard_after_forward", "ddp_sharded-wrapper_kwargs"],
)
def test_different_strategy_options_on_two_ranks_are_refused_naming_both(
    strategy: DirectReferenceStrategy | str, option: str, value: Any
) -> None:
    with pytest.raises(Exception, match=DISAGREE) as refused:
        fit(strategy, new_model(), callbacks=[RankOneOption(option, value)], max_epochs=1)
    message = str(refused.value)
    assert "strategy's options" in message and f"rank 1 has {value!r}" in message
    assert "configure the strategy the same way" in message


@pytest.mark.parametrize(
    ("strategy", "option", "value", "shown"),
    [
        ("fsdp2_fork", "_mixed_precision", MixedPrecisionPolicy(param_dtype=torch.bfloat16), "'torch.bfloat16'"),
        (
            "fsdp_fairscale_fork",
            "_fsdp_kwargs",
            {"state_dict_on_rank_0_only": True, "compute_dtype": torch.float16},
            "'compute_dtype': 'torch.float16'",
        ),
    ],
    ids=["fsdp2-MixedPrecisionPolicy", "fsdp_fairscale-dtype"],
)
def test_options_that_are_not_plain_values_are_compared_by_value(
    strategy: str, option: str, value: Any, shown: str
) -> None:
    with pytest.raises(Exception, match=DISAGREE) as refused:
        fit(strategy, new_model(), callbacks=[RankOneOption(option, value)], max_epochs=1)
    message = str(refused.value)
    assert f"{option.lstrip('_')}: rank 0 has" in message and shown in message


def test_different_save_paths_on_two_ranks_are_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=DISAGREE) as refused:
        fit("ddp_sharded_fork", new_model(), callbacks=[SaveToOwnPath(tmp_path)], max_epochs=1)
    message = str(refused.value)
    assert str(tmp_path / "rank0.ckpt") in message and str(tmp_path / "rank1.ckpt") in message
    assert "broadcast" in message
    assert not list(tmp_path.glob("*.ckpt"))  # refused before anything was written


def test_different_sharded_directories_on_two_ranks_are_refused(tmp_path: Path) -> None:
    strategy = FSDP2Strategy(start_method="fork", state_dict_type="sharded")
    with pytest.raises(Exception, match=DISAGREE):
        fit(strategy, new_model(), callbacks=[SaveToOwnPath(tmp_path)], max_epochs=1)
    assert not list(tmp_path.iterdir())


def test_the_same_options_and_paths_pass_the_checks(tmp_path: Path) -> None:
    saved = train_and_save(FSDP2Strategy(start_method="fork", reshard_after_forward=False), tmp_path / "saved")
    fit("fsdp2_fork", new_model(), ckpt_path=saved, max_epochs=2)


def test_resuming_on_one_rank_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    # One script per rank, where only rank 1 is given the checkpoint (ckpt_path from a rank-local config).
    saved = train_and_save("ddp_sharded_fork", tmp_path / "saved")
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "FAIL_RANK_CKPT_ONLY_ON_RANK": "1"}
    command = [sys.executable, str(SCRIPT), "ddp_sharded", "none", str(tmp_path), "1", str(saved)]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode != 0
    assert DISAGREE in completed.stderr and "the checkpoint to resume from" in completed.stderr, completed.stderr[
        -3000:
    ]
    assert f"rank 0 has None, rank 1 has {str(saved)!r}" in completed.stderr
    assert completed.stderr.count("RanksDisagreeError") >= 2  # raised on both ranks
