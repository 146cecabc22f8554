"""Every strategy on one GPU with NCCL: fit, save, resume under every other strategy exactly; mixed precision; offload.

World size 1: NCCL runs one rank per GPU, so two ranks need two GPUs. What only two or more ranks show (reduce-scatter
of gradients, sharded optimizer state across ranks, rank-0-only gathers) is covered on CPU with gloo (the rest of the
suite), not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_strategies import FSDP2Strategy
from tests.gpu.conftest import BACKEND, ONE_DEVICE, REHEARSAL, needs_cuda, needs_fp16_autocast
from tests.support.helpers import assert_resume_continues_the_run, assert_resume_restores_exactly, fit, new_model

pytestmark = needs_cuda

STRATEGIES = ["ddp", "ddp_sharded", "fsdp_fairscale", "fsdp2"]
OURS = ["ddp_sharded", "fsdp_fairscale", "fsdp2"]


class DeviceRecorder(pl.Callback):
    """Records, after the first training step, the process group's backend and bound device and where the wrapped
    model's parameters and the optimizer's state live."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.seen:
            return
        group = torch.distributed.distributed_c10d._get_default_group()
        optimizer = trainer.optimizers[0]
        # fairscale's OSS keeps this rank's state in the optimizer it shards for (its own `state` stays empty).
        optimizer_state = getattr(optimizer, "optim", optimizer).state.values()
        self.seen = {
            "backend": torch.distributed.get_backend(),
            "bound_device": getattr(group, "bound_device_id", None),
            "parameters": {p.device.type for p in trainer.strategy.model.parameters()},
            # Adam's `step` counter is a CPU scalar by torch's design (unless `capturable`): not a misplaced state.
            "optimizer_state": {
                v.device.type for s in optimizer_state for k, v in s.items() if torch.is_tensor(v) and k != "step"
            },
        }


@pytest.mark.parametrize("strategy", OURS)
def test_a_strategy_on_one_gpu_trains_with_nccl_bound_to_its_device(strategy: str) -> None:
    recorder = DeviceRecorder()
    fit(strategy, new_model(), callbacks=[recorder], max_epochs=1, **ONE_DEVICE)

    device = "cpu" if REHEARSAL else "cuda"
    assert recorder.seen["backend"] == BACKEND
    assert recorder.seen["bound_device"] == (None if REHEARSAL else torch.device("cuda", 0))
    assert recorder.seen["parameters"] == {device}
    assert recorder.seen["optimizer_state"] == {device}


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(a, b) for a in STRATEGIES for b in STRATEGIES if a != b])
def test_a_checkpoint_saved_on_one_gpu_restores_exactly_under_every_other_strategy(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    assert_resume_restores_exactly(tmp_path, saved_by, resumed_by, **ONE_DEVICE)


@pytest.mark.parametrize("strategy", OURS)
@pytest.mark.parametrize("direction", ["saved by it, resumed by ddp", "saved by ddp, resumed by it"])
def test_a_run_resumed_on_one_gpu_continues_the_uninterrupted_run(
    tmp_path: Path, strategy: str, direction: str
) -> None:
    saved_by, resumed_by = (strategy, "ddp") if direction.startswith("saved by it") else ("ddp", strategy)
    assert_resume_continues_the_run(tmp_path, saved_by, resumed_by, **ONE_DEVICE)


@pytest.mark.parametrize("strategy", OURS)
@pytest.mark.parametrize("precision", [pytest.param("16-mixed", marks=needs_fp16_autocast), "bf16-mixed"])
def test_mixed_precision_on_one_gpu_saves_what_ddp_restores_exactly(
    tmp_path: Path, strategy: str, precision: str
) -> None:
    saved, restored = assert_resume_restores_exactly(tmp_path, strategy, "ddp", precision=precision, **ONE_DEVICE)

    before = torch.load(saved, weights_only=True)
    after = torch.load(restored, weights_only=True)
    assert all(torch.isfinite(value).all() for value in before["state_dict"].values())
    if precision == "16-mixed":  # the loss scaler's state travels with the checkpoint (Lightning 2 keys it by plugin)
        assert "scale" in before["MixedPrecision"]
        assert before["MixedPrecision"] == after["MixedPrecision"]


OFFLOADED = {
    "fsdp_fairscale_offload": "fsdp_fairscale_offload",
    "fsdp2 cpu_offload": lambda: FSDP2Strategy(cpu_offload=True),
}


@pytest.mark.parametrize("name", list(OFFLOADED))
def test_cpu_offload_keeps_parameters_on_the_host_and_resumes_exactly_under_ddp(tmp_path: Path, name: str) -> None:
    make = OFFLOADED[name]
    recorder = DeviceRecorder()
    fit(make() if callable(make) else make, new_model(), callbacks=[recorder], max_epochs=1, **ONE_DEVICE)

    assert recorder.seen["parameters"] == {"cpu"}  # the sharded parameters that the optimizer steps live on the host
    assert_resume_restores_exactly(tmp_path, make() if callable(make) else make, "ddp", **ONE_DEVICE)
