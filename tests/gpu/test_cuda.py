"""CUDA + NCCL conformance on a lent GPU machine (see docs/gpu.md); skipped where CUDA is absent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pytorch_lightning.strategies import Strategy

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
    from lightning_strategies.fairscale import cpu as fairscale_cpu

    assert not fairscale_cpu.install()


# ---------------------------------------------------------------------------------------------- precision="16-mixed"


def _fp16_strategies() -> dict[str, Callable[[], Strategy]]:
    from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy

    return {
        "ddp_sharded": ShardedDDPStrategy,
        "fsdp_fairscale": FairScaleFSDPStrategy,
        "fsdp_fairscale(mixed_precision=True)": lambda: FairScaleFSDPStrategy(mixed_precision=True),
        "fsdp2": FSDP2Strategy,
    }


FP16_TOLERANCE = {"fsdp_fairscale(mixed_precision=True)": 5e-3}  # fp16 parameters, not only fp16 matmuls


@pytest.mark.parametrize("name", list(_fp16_strategies()))
def test_fp16_mixed_on_one_gpu_trains_like_ddp(name: str) -> None:
    # On CUDA, precision="16-mixed" is Lightning's MixedPrecision with a CUDA GradScaler; the fairscale strategies
    # swap it for one whose skip-or-step decision is all-reduced over NCCL.
    from lightning_strategies.testing.state import max_state_difference
    from tests.support.helpers import fit, new_model

    gpu = {"accelerator": "gpu", "devices": 1, "precision": "16-mixed"}
    expected = new_model("adam")
    fit("ddp", expected, **gpu)
    model = new_model("adam")
    fit(_fp16_strategies()[name](), model, **gpu)
    difference, key = max_state_difference(expected.state_dict(), model.state_dict())
    assert difference <= FP16_TOLERANCE.get(name, 1e-3), f"{key} differs by {difference}"


@pytest.mark.parametrize("name", list(_fp16_strategies()))
def test_fp16_mixed_on_one_gpu_skips_an_overflowing_step_and_halves_the_scale(tmp_path: Path, name: str) -> None:
    from tests.strategies.test_mixed_precision import OverflowOnOneRank, ScaleRecorder
    from tests.support.helpers import fit, new_model

    (tmp_path / "steps").mkdir()
    (tmp_path / "scales").mkdir()
    overflow = OverflowOnOneRank(tmp_path / "steps", rank=0, step=2)
    scales = ScaleRecorder(tmp_path / "scales")
    model = new_model("adam")
    fit(
        _fp16_strategies()[name](),
        model,
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_epochs=1,
        callbacks=[overflow, scales],
    )

    (changed,) = overflow.recorder.read(1)
    (scale,) = scales.read(1)
    assert changed[2] is False and all(changed[3:])
    assert scale[1] == 2.0**16 and scale[2] == 2.0**15
