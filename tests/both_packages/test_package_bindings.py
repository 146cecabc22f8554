"""Our classes are bound to the Lightning package the user imports, and only to it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_strategies.checkpoint
from tests.support.flavour import PACKAGE, ours, pl, testing

ROOT = Path(__file__).parents[2]


def _fresh_interpreter(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.strip()


@pytest.mark.parametrize("name", ["ShardedDDPStrategy", "FairScaleFSDPStrategy", "FSDP2Strategy"])
def test_each_strategy_is_a_strategy_of_the_package_in_use(name: str) -> None:
    assert issubclass(getattr(ours, name), pl.strategies.Strategy)


@pytest.mark.parametrize("name", ["ddp_sharded_fork", "fsdp_fairscale_fork", "fsdp_fairscale_offload", "fsdp2_fork"])
def test_each_name_is_registered_with_the_package_in_use(name: str) -> None:
    assert isinstance(pl.strategies.StrategyRegistry.get(name), ours.DirectReferenceStrategy)


def test_the_export_callback_is_a_callback_of_the_package_in_use() -> None:
    callbacks = importlib.import_module(f"{ours.__name__}.callbacks")  # safetensors is imported only when writing
    assert issubclass(callbacks.SafetensorsExport, pl.Callback)


def test_both_bindings_run_one_source_file() -> None:
    source = Path(sys.modules[ours.FSDP2Strategy.__module__].__file__ or "")
    assert source == ROOT / "lightning_strategies" / "strategies" / "fsdp2.py"


def test_the_checkpoint_package_and_its_errors_are_shared_by_both_bindings() -> None:
    flow = importlib.import_module(f"{ours.__name__}.strategies.checkpointing")  # where the strategies load from
    assert flow.CheckpointFormatError is lightning_strategies.checkpoint.CheckpointFormatError


def test_our_package_imports_in_an_environment_without_the_other_lightning_package() -> None:
    # CI runs this once where only pytorch-lightning is installed and once where only lightning is.
    tree = ours.__name__
    top_level = _fresh_interpreter(
        f"import sys, {tree}, {tree}.testing; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    ).split()
    bound_to = {"pytorch_lightning", "lightning_fabric"} if PACKAGE == "pytorch_lightning" else {"lightning"}
    assert bound_to <= set(top_level)


def test_spawned_workers_import_the_same_binding_and_hand_back_the_weights() -> None:
    pl.seed_everything(3, verbose=False)
    model = testing.ConformanceModel()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="fsdp2_spawn",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)

    assert any(not torch.equal(before[key], value) for key, value in model.state_dict().items())
