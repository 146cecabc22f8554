"""FairScaleFSDPStrategy on 2 CPU processes: the issue-13500 case, conformance, training math, sharded checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.wrap import wrap
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import StrategyRegistry

from lightning_strategies import FairScaleFSDPStrategy
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore, assert_strategy_conforms, make_dataset
from tests.support.helpers import (
    RankRecorder,
    assert_resume_continues_the_run,
    assert_resume_restores_exactly,
    assert_same_checkpoint_state,
    assert_same_weights,
    fit,
    new_model,
    train_and_save,
)


def fsdp(**kwargs: Any) -> FairScaleFSDPStrategy:
    return FairScaleFSDPStrategy(start_method="fork", **kwargs)


class UserWrappedModel(ConformanceModel):
    """Wraps its encoder itself, the fairscale way, in configure_model."""

    def configure_model(self) -> None:
        if not isinstance(self.encoder, FullyShardedDataParallel):
            self.encoder = wrap(self.encoder)


# ---------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("name", "start_method"),
    [
        ("fsdp_fairscale", "popen"),
        ("fsdp_fairscale_spawn", "spawn"),
        ("fsdp_fairscale_fork", "fork"),
        ("fsdp_fairscale_offload", "popen"),
    ],
)
def test_importing_the_package_registers_each_name(name: str, start_method: str) -> None:
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, FairScaleFSDPStrategy)
    assert strategy._start_method == start_method


def test_the_offload_variant_offloads_parameters_and_gradients() -> None:
    strategy = StrategyRegistry.get("fsdp_fairscale_offload")
    assert strategy._fsdp_kwargs["cpu_offload"] is True
    assert strategy._fsdp_kwargs["move_grads_to_cpu"] is True


def test_an_unknown_keyword_argument_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"find_unused_parameters.*It takes: .*flatten_parameters"):
        FairScaleFSDPStrategy(find_unused_parameters=True)


def test_an_unknown_state_dict_type_is_refused() -> None:
    with pytest.raises(ValueError, match="state_dict_type must be 'full' or 'sharded'"):
        FairScaleFSDPStrategy(state_dict_type="local")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fsdp_fairscale_fork_conforms(tmp_path: Path, optimizer: str) -> None:
    assert_strategy_conforms(lambda: "fsdp_fairscale_fork", tmp_path, optimizer=optimizer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"flatten_parameters": False},
        {"auto_wrap_min_params": 100},
        {"reshard_after_forward": False},
        {"cpu_offload": True, "move_grads_to_cpu": True},
    ],
    ids=["non-flat", "auto-wrapped", "no-reshard", "offload"],
)
def test_variants_conform(tmp_path: Path, options: dict[str, Any]) -> None:
    assert_strategy_conforms(lambda: fsdp(**options), tmp_path)


def test_submodules_the_user_wraps_in_configure_model_conform(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: fsdp(), tmp_path, model_class=UserWrappedModel)


def test_mixed_precision_conforms_within_half_precision_tolerance(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: fsdp(mixed_precision=True), tmp_path, atol=5e-3)


# ---------------------------------------------------------------------------------------------- issue 13500


PAIRS = [
    ("fsdp_fairscale_fork", "ddp_sharded_fork"),
    ("ddp_sharded_fork", "fsdp_fairscale_fork"),
    ("fsdp_fairscale_fork", "ddp_fork"),
    ("ddp_fork", "fsdp_fairscale_fork"),
]


@pytest.mark.parametrize(("saved_by", "resumed_by"), PAIRS)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resuming_restores_exactly_the_saved_model_and_optimizer_state(
    tmp_path: Path, saved_by: str, resumed_by: str, optimizer: str
) -> None:
    assert_resume_restores_exactly(tmp_path, saved_by, resumed_by, optimizer)


@pytest.mark.parametrize(("saved_by", "resumed_by"), PAIRS)
def test_no_loss_spike_and_the_same_weights_as_an_uninterrupted_run(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    assert_resume_continues_the_run(tmp_path, saved_by, resumed_by)


def test_a_checkpoint_holds_the_unwrapped_keys_and_rank_0s_gathered_weights(tmp_path: Path) -> None:
    saved = train_and_save("fsdp_fairscale_fork", tmp_path)
    checkpoint = torch.load(saved, weights_only=True)

    assert list(checkpoint["state_dict"]) == list(ConformanceModel().state_dict())
    assert checkpoint["lightning_strategies"]["strategy"] == "fsdp_fairscale"
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    shapes = [tuple(entries["exp_avg"].shape) for entries in checkpoint["optimizer_states"][0]["state"].values()]
    assert shapes == [(16, 8), (16,), (4, 16), (4,)]


# ---------------------------------------------------------------------------------------------- training math


def _fit_pair(
    strategy: Any, optimizer: str = "adam", **overrides: Any
) -> tuple[pl.LightningModule, pl.LightningModule]:
    reference = new_model(optimizer)
    fit("ddp_fork", reference, **overrides)
    model = new_model(optimizer)
    fit(strategy, model, **overrides)
    return reference, model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_matches_upstream_ddp(optimizer: str) -> None:
    reference, model = _fit_pair("fsdp_fairscale_fork", optimizer, max_epochs=3)
    assert_same_weights(reference, model, atol=1e-5)


def test_gradient_accumulation_matches_upstream_ddp() -> None:
    reference, model = _fit_pair("fsdp_fairscale_fork", "sgd", accumulate_grad_batches=3)
    assert_same_weights(reference, model, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_upstream_ddp(algorithm: str) -> None:
    reference, model = _fit_pair(
        "fsdp_fairscale_fork", "sgd", gradient_clip_val=0.05, gradient_clip_algorithm=algorithm
    )
    assert_same_weights(reference, model, atol=1e-5)


def test_the_same_optimizer_works_without_flattening() -> None:
    reference, model = _fit_pair(fsdp(flatten_parameters=False), max_epochs=1)
    assert_same_weights(reference, model, atol=1e-5)


def test_param_groups_by_submodule_get_their_own_flat_parameters(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        return {
            "groups": [len(group["params"]) for group in optimizer.param_groups],
            "lrs": [g["lr"] for g in optimizer.param_groups],
        }

    recorder = RankRecorder(tmp_path, "on_train_start", probe)
    fit("fsdp_fairscale_fork", new_model(), callbacks=[recorder], max_epochs=1)
    for record in recorder.read():
        assert record == {"groups": [1, 1], "lrs": [0.02, 0.01]}  # one flat parameter per submodule


# ---------------------------------------------------------------------------------------------- evaluation


def _plain_loss(model: torch.nn.Module, seed: int) -> float:
    data = make_dataset(8, seed=seed)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]))


def _evaluator() -> pl.Trainer:
    return pl.Trainer(
        strategy="fsdp_fairscale_fork", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
    )


def test_test_without_fit_computes_the_plain_modules_loss() -> None:
    (result,) = _evaluator().test(new_model(), verbose=False)
    assert result["test_loss"] == pytest.approx(_plain_loss(new_model(), 98), abs=1e-6)


def test_validate_after_fit_uses_the_trained_weights() -> None:
    model = new_model()
    fit("fsdp_fairscale_fork", model, max_epochs=1)
    (result,) = _evaluator().validate(model, verbose=False)
    assert result["val_loss"] == pytest.approx(_plain_loss(model, 99), abs=1e-6)


def test_test_from_a_checkpoint_uses_its_weights(tmp_path: Path) -> None:
    saved = train_and_save("fsdp_fairscale_fork", tmp_path)
    (result,) = _evaluator().test(new_model(seed=11), ckpt_path=saved, verbose=False)
    trained = ConformanceModel.load_from_checkpoint(saved, weights_only=True)
    assert result["test_loss"] == pytest.approx(_plain_loss(trained, 98), abs=1e-6)


# ---------------------------------------------------------------------------------------------- sharded checkpoints


def _save_sharded(directory: Path, strategy: Any = None) -> Path:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(
        strategy or fsdp(state_dict_type="sharded"),
        new_model(),
        callbacks=[checkpoints],
        max_epochs=1,
        enable_checkpointing=True,
    )
    return directory / "epoch=0.ckpt"


def test_a_sharded_checkpoint_is_a_directory_of_rank_files_holding_local_shards(tmp_path: Path) -> None:
    saved = _save_sharded(tmp_path)

    assert sorted(path.name for path in saved.iterdir()) == ["meta.pt", "rank0.pt", "rank1.pt"]
    meta = torch.load(saved / "meta.pt", weights_only=True)
    assert meta["lightning_strategies"]["state_dict_type"] == "sharded"
    assert "state_dict" not in meta
    total = sum(p.numel() for p in ConformanceModel().parameters())
    for rank in range(2):
        shard = torch.load(saved / f"rank{rank}.pt", weights_only=True)
        local = sum(value.numel() for key, value in shard["state_dict"].items() if "flat_param" in key)
        assert local < total  # a shard, not a gathered copy


def test_a_sharded_checkpoint_resumes_at_the_same_world_size_like_an_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = new_model()
    fit(fsdp(state_dict_type="sharded"), uninterrupted, max_epochs=2)
    saved = _save_sharded(tmp_path)
    resumed = new_model()
    fit(fsdp(state_dict_type="sharded"), resumed, ckpt_path=saved, max_epochs=2)

    assert_same_weights(uninterrupted, resumed, atol=1e-6)


def test_a_sharded_checkpoint_at_another_world_size_is_read_whole_and_restored_exactly(tmp_path: Path) -> None:
    saved = _save_sharded(tmp_path)
    restored = tmp_path / "restored.ckpt"
    fit(fsdp(), new_model(), ckpt_path=saved, devices=1, max_epochs=2, callbacks=[SaveAfterRestore(restored)])
    assert_same_checkpoint_state(saved, restored)


def test_a_sharded_checkpoint_given_to_another_strategy_is_read_whole_and_restored_exactly(tmp_path: Path) -> None:
    saved = _save_sharded(tmp_path)
    restored = tmp_path / "restored.ckpt"
    fit("ddp_sharded_fork", new_model(), ckpt_path=saved, max_epochs=2, callbacks=[SaveAfterRestore(restored)])
    assert_same_checkpoint_state(saved, restored)


# ---------------------------------------------------------------------------------------------- launchers


def test_the_cpu_patches_are_removed_when_an_in_process_run_ends() -> None:
    from lightning_strategies.fairscale import cpu as fairscale_cpu

    fit("fsdp_fairscale", new_model(), devices=1, max_epochs=1)  # one device: runs in this process
    assert not fairscale_cpu.is_installed()


def test_saving_every_epoch_leaves_training_unchanged() -> None:
    # Gathering the optimizer state for a checkpoint must not touch the live optimizer.
    reference = new_model()
    fit("ddp_fork", reference, max_epochs=3)
    model = new_model()
    checkpoints = ModelCheckpoint(dirpath=None, save_top_k=-1, every_n_epochs=1)
    fit("fsdp_fairscale_fork", model, callbacks=[checkpoints], max_epochs=3, enable_checkpointing=True)

    assert_same_weights(reference, model, atol=1e-5)


def test_predict_from_a_checkpoint_uses_its_weights(tmp_path: Path) -> None:
    saved = train_and_save("fsdp_fairscale_fork", tmp_path / "saved")
    model = new_model(seed=11, record_dir=str(tmp_path))
    _evaluator().predict(model, ckpt_path=saved, return_predictions=False)

    trained = ConformanceModel.load_from_checkpoint(saved, weights_only=True)
    inputs = make_dataset(8, seed=97).tensors[0]
    for rank in range(2):
        got = torch.load(tmp_path / f"predictions-rank{rank}.pt", weights_only=True)
        with torch.no_grad():
            assert torch.allclose(got, trained(inputs[rank::2]), atol=1e-6)


def test_a_second_run_after_the_process_group_was_recreated_works(tmp_path: Path) -> None:
    # fairscale caches its process groups for the life of the process; a new process group makes them stale.
    fit("fsdp_fairscale", new_model(), devices=1, max_epochs=1)
    torch.distributed.destroy_process_group()
    saved = train_and_save(FairScaleFSDPStrategy(), tmp_path, devices=1)

    assert torch.load(saved, weights_only=True)["optimizer_states"][0]["state"]


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp_fairscale_offload"])
def test_the_script_launched_variants_conform_on_one_process(tmp_path: Path, name: str) -> None:
    # One device: the subprocess launcher starts nothing, so the kit runs them in this process.
    assert_strategy_conforms(lambda: name, tmp_path, devices=1)


def test_after_an_in_process_fit_the_module_is_plain_again_and_runs_the_next_stage(tmp_path: Path) -> None:
    model = new_model()
    trainer = pl.Trainer(
        strategy="fsdp_fairscale", accelerator="cpu", devices=1, logger=False, max_epochs=1, default_root_dir=tmp_path
    )
    trainer.fit(model)

    assert not [name for name, child in model.named_modules() if isinstance(child, FullyShardedDataParallel)]
    assert [name for name, _ in model.named_parameters()] == [
        "encoder.weight",
        "encoder.bias",
        "head.weight",
        "head.bias",
    ]
    (result,) = trainer.test(model, verbose=False)
    assert result["test_loss"] == pytest.approx(_plain_loss(model, 98), abs=1e-6)


def test_a_sharded_checkpoint_without_its_completion_marker_is_refused(tmp_path: Path) -> None:
    saved = _save_sharded(tmp_path)
    (saved / "meta.pt").unlink()  # as if the save had been killed before its last write
    with pytest.raises(Exception, match=r"has no meta.pt: its save did not finish"):
        fit(fsdp(state_dict_type="sharded"), new_model(), ckpt_path=saved)


@pytest.mark.parametrize("start_method", ["fork", "popen"])
def test_trainer_save_checkpoint_after_fit_holds_the_trained_weights(tmp_path: Path, start_method: str) -> None:
    model = new_model()
    devices = 2 if start_method == "fork" else 1
    trainer = fit(FairScaleFSDPStrategy(start_method=start_method), model, devices=devices)  # type: ignore[arg-type]

    trainer.save_checkpoint(tmp_path / "after-fit.ckpt")  # the FSDP root is gone: the module holds the weights

    saved = torch.load(tmp_path / "after-fit.ckpt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(saved["state_dict"][key], value), key


def test_trainer_save_checkpoint_after_an_in_process_fit_writes_canonical_optimizer_state(tmp_path: Path) -> None:
    model = new_model()
    trainer = fit(FairScaleFSDPStrategy(start_method="popen"), model, devices=1)

    trainer.save_checkpoint(tmp_path / "after-fit.ckpt")  # the optimizer still holds flat shards: gathered by name

    optimizer_state = torch.load(tmp_path / "after-fit.ckpt", weights_only=True)["optimizer_states"][0]
    assert [len(group["params"]) for group in optimizer_state["param_groups"]] == [2, 2]
    shapes = [param.shape for param in model.parameters()]
    assert [optimizer_state["state"][index]["exp_avg"].shape for index in range(4)] == shapes
