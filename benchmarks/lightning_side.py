"""The Lightning side of each comparison: a Trainer configured as a user who benchmarks would configure it."""

from __future__ import annotations

import time
from typing import Any, Literal

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.strategies import ModelParallelStrategy, Strategy
from torch.optim import Optimizer

from lightning_strategies import FSDP2Strategy  # importing the package registers ddp_sharded, fsdp_fairscale, fsdp2

from .by_hand import Wrapped
from .config import (
    FSDP2_READ_WHOLE,
    FSDP2_SHARDED,
    MODEL_PARALLEL,
    MODEL_PARALLEL_FULL,
    UPSTREAM_FSDP_SHARDED,
    is_upstream_fsdp,
)
from .models import BenchModule


def strategy_for(name: str, module: BenchModule) -> str | Strategy:
    """The strategy a benchmark variant names, configured for ``module``.

    ``fsdp2`` shards each of ``module.block_classes()`` too (``shard_module_classes``); the ``model_parallel`` names
    build ``ModelParallelStrategy`` over every rank with ``tensor_parallel_size=1`` (the module shards itself in
    ``configure_model``, see ``models.shard_like_fsdp2``); ``fsdp`` and ``fsdp_sharded`` build upstream's
    ``FSDPStrategy`` with the test suite's CPU fixes (the module wraps itself, see
    ``models.wrap_like_fsdp2_with_fsdp1``); other names are registered strategy names.
    """
    if name in (MODEL_PARALLEL, MODEL_PARALLEL_FULL):
        return ModelParallelStrategy(
            data_parallel_size=dist.get_world_size(),
            tensor_parallel_size=1,
            save_distributed_checkpoint=name == MODEL_PARALLEL,
        )
    if is_upstream_fsdp(name):
        return fsdp_strategy_on_cpu("sharded" if name == UPSTREAM_FSDP_SHARDED else "full")
    if name == FSDP2_READ_WHOLE:
        blocks = {"shard_module_classes": module.block_classes()} if module.block_classes() else {}
        return FSDP2Strategy(checkpoint_io=TorchCheckpointIO(), **blocks)
    if name == FSDP2_SHARDED:
        return FSDP2Strategy(state_dict_type="sharded", shard_module_classes=module.block_classes())
    if name == "fsdp2" and module.block_classes():
        return FSDP2Strategy(shard_module_classes=module.block_classes())
    return name


def fsdp_strategy_on_cpu(state_dict_type: Literal["full", "sharded"]) -> Strategy:
    """Upstream's ``FSDPStrategy`` with the fixes it needs on the CPU (``tests/support/upstream_runs.py``: past the
    accelerator check, full saves without ``offload_to_cpu``), as the interoperability tests run it.

    Imported here: ``tests.support.upstream_runs`` brings the test helpers (and ``transformers``) along, which runs
    without upstream's ``FSDPStrategy`` do not need.
    """
    from tests.support.upstream_runs import FSDPStrategyOnCPU

    strategy: Strategy = FSDPStrategyOnCPU(state_dict_type=state_dict_type)
    return strategy


def trainer(strategy: str | Strategy, callbacks: list[pl.Callback], **overrides: Any) -> pl.Trainer:
    """A CPU Trainer over this process group without logging, progress bar, summary, checkpointing or validation.

    The workers are started like ``torchrun`` starts them (``LOCAL_RANK`` etc. set) and already hold the process
    group, so the strategy launches nothing and joins the existing group.
    """
    return pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **overrides,
    )


def raw_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (or the optimizer itself)."""
    inner: Optimizer = getattr(optimizer, "_optimizer", optimizer)
    return inner


def wrapped_by_strategy(strategy_name: str, trainer: pl.Trainer) -> Wrapped:
    """The wrapper and optimizer a running strategy built, for the hand-written side to use with their own API."""
    module = trainer.lightning_module
    wrapper = trainer.strategy.model
    if wrapper is None:
        raise RuntimeError("The strategy has no model yet: call this inside fit.")
    return Wrapped(strategy_name, module, wrapper, raw_optimizer(trainer.strategy.optimizers[0]))


class StepTimer(pl.Callback):
    """Times each training step between ``on_train_batch_start`` and ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.durations: list[float] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.durations.append(time.perf_counter() - self.starts[-1])


class FirstStepLatency(pl.Callback):
    """Seconds from ``start`` (taken just before ``fit``) to the first ``on_train_batch_start``; then stops."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.latency: float | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.latency is None:
            self.latency = time.perf_counter() - self.start

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trainer.should_stop = True
