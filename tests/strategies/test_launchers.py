"""The launcher that fork and spawn tests do not cover: one script started per rank (the registry's plain names)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_strategies.checkpoint import check_model_state
from lightning_strategies.testing import ConformanceModel

SCRIPT = Path(__file__).parents[1] / "scripts" / "train.py"


@pytest.mark.parametrize("strategy", ["ddp_sharded", "fsdp_fairscale"])
def test_subprocess_launcher_trains_and_saves_a_canonical_checkpoint(
    tmp_path: Path, loopback_rendezvous: int, strategy: str
) -> None:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]

    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    check_model_state(ConformanceModel().state_dict(), checkpoint["state_dict"])
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert checkpoint["lightning_strategies"] == {
        "format_version": 1,
        "strategy": strategy,
        "world_size": 2,
        "state_dict_type": "full",
    }
