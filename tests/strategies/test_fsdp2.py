"""FSDP2Strategy (torch fully_shard) on CPU: conformance, the move off fairscale, training math, DCP resharding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import StrategyRegistry
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_strategies import FSDP2Strategy
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore, assert_strategy_conforms
from tests.support.helpers import (
    RankRecorder,
    assert_resume_continues_the_run,
    assert_resume_restores_exactly,
    assert_same_weights,
    canonical_checkpoint,
    fit,
    new_model,
    train_and_save,
)


def fsdp2(**kwargs: Any) -> FSDP2Strategy:
    return FSDP2Strategy(start_method="fork", **kwargs)


class UserShardedModel(ConformanceModel):
    """Shards its encoder itself in configure_model, on the strategy's mesh."""

    def configure_model(self) -> None:
        strategy = self._trainer.strategy if self._trainer is not None else None  # None in load_from_checkpoint
        if isinstance(strategy, FSDP2Strategy) and not isinstance(self.encoder, FSDPModule):
            fully_shard(self.encoder, mesh=strategy.device_mesh)


@pytest.mark.parametrize(
    ("name", "start_method"), [("fsdp2", "popen"), ("fsdp2_spawn", "spawn"), ("fsdp2_fork", "fork")]
)
def test_importing_the_package_registers_each_name(name: str, start_method: str) -> None:
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, FSDP2Strategy)
    assert strategy._start_method == start_method


# ---------------------------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fsdp2_fork_conforms(tmp_path: Path, optimizer: str) -> None:
    assert_strategy_conforms(lambda: "fsdp2_fork", tmp_path, optimizer=optimizer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"shard_module_classes": {torch.nn.Linear}},
        {"min_num_params": 50},
        {"reshard_after_forward": False},
        {"cpu_offload": True},
        {"activation_checkpointing": {torch.nn.Linear}},
    ],
    ids=["by-class", "by-size", "no-reshard", "offload", "activation-checkpointing"],
)
def test_variants_conform(tmp_path: Path, options: dict[str, Any]) -> None:
    assert_strategy_conforms(lambda: fsdp2(**options), tmp_path)


def test_bf16_mixed_precision_conforms_within_bf16_tolerance(tmp_path: Path) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert_strategy_conforms(lambda: fsdp2(mixed_precision=policy), tmp_path, atol=3e-2)


def test_the_users_own_fully_shard_calls_are_kept_and_conform(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: fsdp2(), tmp_path, model_class=UserShardedModel)


def test_the_in_process_variant_conforms_on_one_process(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: "fsdp2", tmp_path, devices=1)


def test_there_is_no_wrapper_and_parameters_are_dtensors(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        strategy = trainer.strategy
        return {
            "model_is_module": strategy.model is module is strategy.lightning_module,
            "dtensors": all(isinstance(p, DTensor) for p in module.parameters()),
            "optimizer_holds_them": {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
            == {id(p) for p in module.parameters()},
        }

    recorder = RankRecorder(tmp_path, "on_train_start", probe)
    fit("fsdp2_fork", new_model(), callbacks=[recorder], max_epochs=1)
    for record in recorder.read():
        assert record == {"model_is_module": True, "dtensors": True, "optimizer_holds_them": True}


# ---------------------------------------------------------------------------------------------- moving off fairscale

PAIRS = [
    ("fsdp_fairscale_fork", "fsdp2_fork"),
    ("fsdp2_fork", "fsdp_fairscale_fork"),
    ("fsdp2_fork", "ddp_fork"),
    ("ddp_fork", "fsdp2_fork"),
    ("fsdp2_fork", "ddp_sharded_fork"),
]


@pytest.mark.parametrize(("saved_by", "resumed_by"), PAIRS)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resuming_restores_exactly_the_saved_model_and_optimizer_state(
    tmp_path: Path, saved_by: str, resumed_by: str, optimizer: str
) -> None:
    assert_resume_restores_exactly(tmp_path, saved_by, resumed_by, optimizer)


class RowPeakSGD(torch.optim.Optimizer):
    """SGD that also keeps each row's largest gradient: state of another shape than its parameter."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                peak = param.grad.abs().amax(dim=-1)
                state = self.state[param]
                state["row_peak"] = torch.maximum(state["row_peak"], peak) if "row_peak" in state else peak
                param.add_(param.grad, alpha=-group["lr"])
        return loss


class RowPeakModel(ConformanceModel):
    def configure_optimizers(self) -> Any:
        return RowPeakSGD(self.parameters())


def test_optimizer_state_of_another_shape_than_its_parameter_resumes_exactly(tmp_path: Path) -> None:
    # Each rank cuts its part of the full state it read only where a state tensor has its parameter's shape; other
    # state goes through torch's loader.
    assert_resume_restores_exactly(tmp_path, "fsdp2_fork", "fsdp2_fork", cls=RowPeakModel)


@pytest.mark.parametrize(("saved_by", "resumed_by"), [*PAIRS[:2], ("fsdp2_fork", "fsdp2_fork")])
def test_no_loss_spike_and_the_same_weights_as_an_uninterrupted_run(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    assert_resume_continues_the_run(tmp_path, saved_by, resumed_by)


# ---------------------------------------------------------------------------------------------- training math


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_matches_upstream_ddp(optimizer: str) -> None:
    reference = new_model(optimizer)
    fit("ddp_fork", reference, max_epochs=3)
    model = new_model(optimizer)
    fit("fsdp2_fork", model, max_epochs=3)

    assert_same_weights(reference, model, atol=1e-5)


@pytest.mark.parametrize(
    "overrides", [{"accumulate_grad_batches": 3}, {"gradient_clip_val": 0.05}], ids=["accumulate", "clip"]
)
def test_accumulation_and_clipping_match_upstream_ddp(overrides: dict[str, Any]) -> None:
    reference = new_model("sgd")
    fit("ddp_fork", reference, **overrides)
    model = new_model("sgd")
    fit("fsdp2_fork", model, **overrides)

    assert_same_weights(reference, model, atol=1e-5)


# ---------------------------------------------------------------------------------------------- sharded (DCP)


def _save_sharded(directory: Path) -> Path:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(fsdp2(state_dict_type="sharded"), new_model(), callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    return directory / "epoch=0.ckpt"


def test_a_sharded_checkpoint_is_a_dcp_directory_with_metadata(tmp_path: Path) -> None:
    saved = _save_sharded(tmp_path)
    files = sorted(path.name for path in saved.iterdir())
    assert ".metadata" in files and "meta.pt" in files
    assert sum(name.endswith(".distcp") for name in files) == 2  # one per rank, no gathered copy
    meta = torch.load(saved / "meta.pt", weights_only=True)
    assert meta["lightning_strategies"]["state_dict_type"] == "sharded"


@pytest.mark.parametrize("devices", [2, 1], ids=["same-world-size", "2-to-1"])
def test_a_sharded_checkpoint_resumes_at_any_world_size_with_the_saved_weights(tmp_path: Path, devices: int) -> None:
    reference = _train_one_epoch_full(tmp_path / "reference")
    saved = _save_sharded(tmp_path / "saved")
    full = tmp_path / "restored.ckpt"
    fit(fsdp2(), new_model(seed=11), ckpt_path=saved, callbacks=[SaveAfterRestore(full)], devices=devices)

    restored = torch.load(full, weights_only=True)
    for key, value in reference["state_dict"].items():
        assert torch.allclose(value, restored["state_dict"][key], atol=1e-6), key


def _train_one_epoch_full(directory: Path) -> dict[str, Any]:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(fsdp2(), new_model(), callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    loaded: dict[str, Any] = torch.load(directory / "epoch=0.ckpt", weights_only=True)
    return loaded


def test_a_sharded_checkpoint_saved_by_one_process_resumes_on_two(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "one", filename="{epoch}", save_top_k=-1)
    one_process = fsdp2(state_dict_type="sharded")  # a forked worker, so nothing stays in the test process
    fit(one_process, new_model(), callbacks=[checkpoints], devices=1, max_epochs=1, enable_checkpointing=True)
    saved = tmp_path / "one" / "epoch=0.ckpt"

    full = tmp_path / "restored.ckpt"
    fit(fsdp2(), new_model(seed=11), ckpt_path=saved, callbacks=[SaveAfterRestore(full)], devices=2)
    restored = torch.load(full, weights_only=True)
    assert sorted(restored["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert list(restored["state_dict"]) == list(ConformanceModel().state_dict())


class _StepUsingParametersWithoutCallingAModule(ConformanceModel):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        hidden = torch.tanh(inputs @ self.encoder.weight.T + self.encoder.bias)
        return torch.nn.functional.mse_loss(self.head(hidden), targets)


@pytest.mark.parametrize(
    "options", [{}, {"shard_module_classes": {torch.nn.Linear}}], ids=["root-only", "submodules-sharded"]
)
def test_a_step_that_uses_parameters_without_calling_their_module_fails_with_the_fix(options: dict[str, Any]) -> None:
    # Steps are called directly and module calls they make run FSDP's hooks; a step that computes with a module's
    # parameters without calling the module must say so, not fail inside a DTensor operator.
    strategy = FSDP2Strategy(start_method="fork", **options)
    with pytest.raises(
        Exception, match=r"training_step computed with parameters that are still sharded.*`self\(\.\.\.\)`"
    ):
        fit(strategy, new_model(cls=_StepUsingParametersWithoutCallingAModule), max_epochs=1)


class ModelWithAnExtraBuffer(ConformanceModel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("calibration", torch.ones(3))


class NonStrictModel(ConformanceModel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strict_loading = False


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_non_strict_loading_ignores_a_key_the_model_lacks_and_restores_the_rest(
    tmp_path: Path, state_dict_type: str
) -> None:
    saved = train_and_save(fsdp2(state_dict_type=state_dict_type), tmp_path / "saved", cls=ModelWithAnExtraBuffer)
    restored = tmp_path / "restored.ckpt"
    fit(fsdp2(), new_model(seed=11, cls=NonStrictModel), ckpt_path=saved, callbacks=[SaveAfterRestore(restored)])
    before, after = canonical_checkpoint(saved)["state_dict"], canonical_checkpoint(restored)["state_dict"]
    assert "calibration" not in after
    for key, value in after.items():
        assert torch.equal(value, before[key]), key
