"""CUDA + NCCL checks for a lent GPU machine (``scripts/gpu_check.sh``); skipped where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_strategies.testing import assert_strategy_conforms

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: run scripts/gpu_check.sh on a GPU machine"
)


@pytest.mark.parametrize("strategy", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_conforms_on_one_gpu_with_nccl(tmp_path: Path, strategy: str, optimizer: str) -> None:
    # One device: the subprocess launcher starts no other process, so this runs in the test process with NCCL.
    assert_strategy_conforms(lambda: strategy, tmp_path, devices=1, accelerator="gpu", optimizer=optimizer)  # type: ignore[arg-type]


def test_fairscale_fsdp_applies_no_cpu_patch_on_a_gpu_machine() -> None:
    from lightning_strategies import fairscale_cpu

    assert not fairscale_cpu.install()
