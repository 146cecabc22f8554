"""Mixed precision under every strategy: 32-bit, bf16 autocast, fp16 autocast with one loss scale for all ranks.

fp16 runs use Lightning's ``MixedPrecision("16-mixed", "cpu")`` (fp16 autocast and a ``GradScaler``): the plugin
``precision="16-mixed"`` builds on a GPU, which Lightning turns into bf16 on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.fairscale.options import FlattenedUnderCachedAutocastError
from lightning_strategies.strategies.precision import AgreeingGradScaler
from lightning_strategies.testing import SaveAfterRestore
from tests.fuzz.recipes import ModelSpec, Recipe, build_module
from tests.support.helpers import RankRecorder, assert_same_weights, fit, new_model, train_and_save

# A collective that waits longer than this failed: a rank that skipped a step alone would leave its peers waiting.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)

StrategyFactory = Callable[[], Any]

SHARDED: dict[str, StrategyFactory] = {
    "ddp_sharded": lambda: ShardedDDPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT),
    "fsdp_fairscale": lambda: FairScaleFSDPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT),
    "fsdp_fairscale(mixed_precision=True)": lambda: FairScaleFSDPStrategy(
        start_method="fork", timeout=COLLECTIVE_TIMEOUT, mixed_precision=True
    ),
    "fsdp2": lambda: FSDP2Strategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT),
}
# fairscale's mixed_precision=True computes with fp16 parameters, not only fp16 matmuls as autocast does.
TOLERANCE = {"fsdp_fairscale(mixed_precision=True)": 5e-3}


def fp16(**scaler_options: Any) -> MixedPrecision:
    """Lightning's fp16 AMP plugin on the CPU, with a GradScaler of the given options."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_options))


def ddp() -> str:
    return "ddp_fork"


def scale_of(trainer: pl.Trainer, module: pl.LightningModule) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else math.nan


def trained(strategy: Any, devices: int, **overrides: Any) -> pl.LightningModule:
    model = new_model("adam")
    fit(strategy, model, devices=devices, **overrides)
    return model


class ScaleRecorder(pl.Callback):
    """Keeps the loss scale after every step; writes each rank's list at the end of training."""

    def __init__(self, directory: Path) -> None:
        self.scales: list[float] = []
        self.recorder = RankRecorder(directory, "on_train_end", lambda *_: self.scales)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.scales.append(scale_of(trainer, module))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.recorder.on_train_end(trainer, module)

    def read(self, world_size: int) -> list[list[float]]:
        result: list[list[float]] = self.recorder.read(world_size)
        return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _stepped_parameters(optimizer: Optimizer) -> list[torch.Tensor]:
    return [_local(param).detach().clone() for group in optimizer.param_groups for param in group["params"]]


class OverflowOnOneRank(pl.Callback):
    """Writes an inf into one gradient that ``rank`` holds after backward of step ``step``, and records on every rank
    whether each step changed the parameters this rank's optimizer steps."""

    def __init__(self, directory: Path, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.changed: list[bool] = []
        self.before: list[torch.Tensor] = []
        self.recorder = RankRecorder(directory, "on_train_end", lambda *_: self.changed)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before = _stepped_parameters(trainer.optimizers[0])

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        # The gradients this rank holds after the reduction: its own shard (the other ranks never see it).
        held = [param.grad for group in trainer.optimizers[0].param_groups for param in group["params"]]
        grad = next(grad for grad in held if grad is not None)
        _local(grad).view(-1)[0] = math.inf

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        after = _stepped_parameters(trainer.optimizers[0])
        self.changed.append(any(not torch.equal(b, a) for b, a in zip(self.before, after, strict=True)))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.recorder.on_train_end(trainer, module)


# ---------------------------------------------------------------------------------------------- which precisions


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("name", list(SHARDED))
def test_fp16_training_matches_ddp(name: str, devices: int) -> None:
    expected = trained(ddp(), devices, plugins=[fp16()])
    model = trained(SHARDED[name](), devices, plugins=[fp16()])
    assert_same_weights(expected, model, atol=TOLERANCE.get(name, 1e-5))


@pytest.mark.parametrize("name", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_bf16_autocast_training_matches_ddp(name: str) -> None:
    expected = trained(ddp(), 2, precision="bf16-mixed")
    model = trained(SHARDED[name](), 2, precision="bf16-mixed")
    assert_same_weights(expected, model, atol=1e-5)


class CachingMixedPrecision(MixedPrecision):
    """bf16 autocast that caches its casts of parameters, as Lightning's ``MixedPrecision`` does before 2.6."""

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=True)


#: Adam after a layer called twice and a weight tied to another layer's: each parameter is used by two bf16 matmuls.
USED_TWICE = Recipe(model=ModelSpec(called_twice=True, tied=True), optimizer="adam")


def test_fsdp_fairscale_trains_parameters_used_twice_like_ddp_under_an_autocast_that_caches_casts() -> None:
    # ddp sums the bf16 gradients of the two uses of a parameter, cast once (cached), before casting them to fp32:
    # fsdp_fairscale leaves the parameters unflattened there, leaves that the cache holds as well.
    expected = build_module(USED_TWICE)
    fit(ddp(), expected, plugins=[CachingMixedPrecision("bf16-mixed", "cpu")])
    model = build_module(USED_TWICE)
    fit(SHARDED["fsdp_fairscale"](), model, plugins=[CachingMixedPrecision("bf16-mixed", "cpu")])
    assert_same_weights(expected, model, atol=1e-5)


def test_fsdp_fairscale_refuses_flattening_under_an_autocast_that_caches_casts_with_the_fix() -> None:
    strategy = FairScaleFSDPStrategy(start_method="fork", timeout=COLLECTIVE_TIMEOUT, flatten_parameters=True)
    refusal = rf"{FlattenedUnderCachedAutocastError.__name__}: .*Pass flatten_parameters=False"
    with pytest.raises(Exception, match=refusal):  # raised on the ranks (the launcher re-raises it with its trace)
        fit(strategy, build_module(USED_TWICE), plugins=[CachingMixedPrecision("bf16-mixed", "cpu")])


@pytest.mark.parametrize("name", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_32_bit_training_matches_ddp(name: str) -> None:
    expected = trained(ddp(), 2)
    model = trained(SHARDED[name](), 2)
    assert_same_weights(expected, model, atol=1e-5)


def test_fsdp2_fp16_parameters_train_like_ddp_fp16() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    expected = trained(ddp(), 2, plugins=[fp16()])
    model = trained(FSDP2Strategy(start_method="fork", mixed_precision=policy), 2, plugins=[fp16()])
    assert_same_weights(expected, model, atol=5e-3)


# ---------------------------------------------------------------------------------------------- one loss scale


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SHARDED))
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path: Path, name: str) -> None:
    overflow = OverflowOnOneRank(tmp_path / "steps", rank=1, step=2)
    scales = ScaleRecorder(tmp_path / "scales")
    (tmp_path / "steps").mkdir()
    (tmp_path / "scales").mkdir()
    fit(SHARDED[name](), new_model("adam"), callbacks=[overflow, scales], plugins=[fp16()], max_epochs=1)

    changed = overflow.recorder.read(2)
    assert [ranks_steps[2] for ranks_steps in changed] == [False, False], changed  # skipped on every rank
    assert all(ranks_steps[3:] and all(ranks_steps[3:]) for ranks_steps in changed), changed  # and went on
    rank0, rank1 = scales.read(2)
    assert rank0 == rank1
    assert rank0[1] == 2.0**16 and rank0[2] == 2.0**15  # halved once, at the step that overflowed


def test_the_users_scaler_is_back_after_fit_holding_the_runs_scale() -> None:
    plugin = fp16(init_scale=2.0**10, growth_interval=3)
    users_scaler = plugin.scaler
    seen: list[object] = []

    class SeeTheScaler(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.append(trainer.precision_plugin.scaler)

    # One device: the run happens in this process, so the plugin seen afterwards is the one that trained.
    fit(ShardedDDPStrategy(), new_model("adam"), devices=1, callbacks=[SeeTheScaler()], plugins=[plugin], max_epochs=1)

    assert isinstance(seen[0], AgreeingGradScaler)
    assert plugin.scaler is users_scaler
    assert users_scaler.get_scale() == 2.0**15  # 16 steps, growth every 3: five doublings from 2**10


def test_a_sharded_grad_scaler_of_the_users_is_kept() -> None:
    users_scaler = ShardedGradScaler("cpu")
    seen: list[object] = []

    class SeeTheScaler(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.append(trainer.precision_plugin.scaler)

    plugin = MixedPrecision("16-mixed", "cpu", scaler=users_scaler)
    fit(ShardedDDPStrategy(), new_model("adam"), devices=1, callbacks=[SeeTheScaler()], plugins=[plugin], max_epochs=1)

    assert seen == [users_scaler]


def test_a_scaler_of_another_class_is_refused_with_the_fix() -> None:
    class OwnScaler(torch.amp.GradScaler):
        pass

    plugin = MixedPrecision("16-mixed", "cpu", scaler=OwnScaler("cpu"))
    with pytest.raises(TypeError, match=r"Pass a torch\.amp\.GradScaler"):
        fit(ShardedDDPStrategy(), new_model("adam"), devices=1, plugins=[plugin], max_epochs=1)


# ---------------------------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("name", list(SHARDED))
def test_fp16_norm_clipping_unscales_first_and_clips_by_the_global_norm(name: str) -> None:
    # A small bound that clips every step: clipping the scaled gradients, or each rank's shard by its own norm,
    # would train differently from ddp.
    overrides = {"plugins": [fp16()], "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    expected = trained(ddp(), 2, **overrides)
    model = trained(SHARDED[name](), 2, **overrides)
    assert_same_weights(expected, model, atol=TOLERANCE.get(name, 1e-5))


# ---------------------------------------------------------------------------------------------- checkpoints


# Lightning 2 keeps the scaler's state under the plugin's class name; Lightning 1 wrote "native_amp_scaling_state".
SCALER_STATE_KEY = MixedPrecision.__qualname__


def _saved_scale(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)[SCALER_STATE_KEY]
    return state


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        ("ddp", "fsdp_fairscale"),
        ("fsdp_fairscale", "ddp"),
        ("ddp", "fsdp_fairscale(mixed_precision=True)"),
        ("ddp", "ddp_sharded"),
        ("ddp_sharded", "ddp"),
        ("ddp", "fsdp2"),
        ("fsdp2", "ddp"),
    ],
)
def test_fp16_checkpoints_resume_across_strategies_with_the_scale_restored(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    factories: dict[str, StrategyFactory] = {"ddp": ddp, **SHARDED}
    # A scale that grew during training (growth every 3 steps), so restoring it is distinguishable from a default.
    plugin = fp16(init_scale=2.0**10, growth_interval=3)
    saved = train_and_save(factories[saved_by](), tmp_path / "saved", plugins=[plugin])
    restored = tmp_path / "restored.ckpt"
    scales = RankRecorder(tmp_path, "on_train_start", scale_of)
    fit(
        factories[resumed_by](),
        new_model("adam", seed=11),
        ckpt_path=saved,
        callbacks=[scales, SaveAfterRestore(restored)],
        plugins=[fp16()],  # a fresh default scaler (2**16): the checkpoint's state must replace it
        max_epochs=2,
    )

    expected = _saved_scale(saved)
    assert expected["scale"] == 2.0**12 and expected["_growth_tracker"] == 2  # 8 steps: doubled after 3 and 6
    assert _saved_scale(restored) == expected
    assert scales.read(2) == [expected["scale"]] * 2  # on every rank


@pytest.mark.parametrize("resumed_by", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_a_lightning_1_checkpoint_restores_its_native_amp_scaling_state(tmp_path: Path, resumed_by: str) -> None:
    saved = train_and_save(ddp(), tmp_path / "saved", plugins=[fp16(init_scale=2.0**10, growth_interval=3)])
    checkpoint = torch.load(saved, weights_only=True)
    legacy = tmp_path / "legacy.ckpt"
    checkpoint["native_amp_scaling_state"] = checkpoint.pop(SCALER_STATE_KEY)
    torch.save(checkpoint, legacy)
    scales = RankRecorder(tmp_path, "on_train_start", scale_of)
    fit(SHARDED[resumed_by](), new_model("adam"), ckpt_path=legacy, callbacks=[scales], plugins=[fp16()], max_epochs=2)

    assert scales.read(2) == [2.0**12] * 2
