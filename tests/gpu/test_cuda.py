"""CUDA + NCCL conformance on a lent GPU machine (see docs/gpu.md); skipped where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_strategies.testing import assert_strategy_conforms
from tests.gpu.conftest import ACCELERATOR, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("strategy", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_conforms_on_one_gpu_with_nccl(tmp_path: Path, strategy: str, optimizer: str) -> None:
    # One device: the subprocess launcher starts no other process, so this runs in the test process with NCCL.
    assert_strategy_conforms(lambda: strategy, tmp_path, devices=1, accelerator=ACCELERATOR, optimizer=optimizer)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="about a machine with CUDA (not rehearsed on CPU)")
def test_fairscale_fsdp_applies_no_cpu_patch_on_a_gpu_machine() -> None:
    from lightning_strategies import fairscale_cpu

    assert not fairscale_cpu.install()
