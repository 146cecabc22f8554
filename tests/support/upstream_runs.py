"""Runs upstream Lightning's sharded strategies and ours side by side on forked ranks (see ``tests/support/ranks.py``).

``FSDPStrategy`` fails on the CPU three times, and the runs apply the three smallest fixes there are (nothing in the
package):

- a subclass (the refusal checks ``type(strategy) is FSDPStrategy``);
- the model wraps its layers in ``configure_model`` with ``device_id=torch.device("cpu")`` (upstream passes the device
  *index*, ``None`` on the CPU, which torch's FSDP1 refuses);
- full saves gather without ``offload_to_cpu`` (upstream always asks for it; on the CPU, FSDP1's offload "moves" the
  gathered flat parameter to the device it is already on, gets the same storage back, frees it, and the state dict's
  clone then reads freed memory: a segfault).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytorch_lightning as pl
import pytorch_lightning.strategies.fsdp as upstream_fsdp
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
    fully_shard,
)
from torch.optim import Optimizer

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.testing.models import ConformanceModel
from lightning_strategies.testing.state import SaveAfterRestore
from tests.support.ranks import run_as_ranks
from tests.zoo.models import GPT2Module

EPOCHS = 2
LOSS_RTOL = 1e-5


def _full_state_without_offload(module: torch.nn.Module, world_size: int, rank0_only: bool = True) -> Any:
    """Upstream's full state-dict context, less ``offload_to_cpu`` (the parameters are on the CPU already)."""
    return FullyShardedDataParallel.state_dict_type(
        module,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


@contextlib.contextmanager
def _gathering_without_offload() -> Iterator[None]:
    """For one call of upstream's save path only (nothing leaks past it)."""
    with mock.patch.object(upstream_fsdp, "_get_full_state_dict_context", _full_state_without_offload):
        yield


class FSDPStrategyOnCPU(FSDPStrategy):
    """Upstream's ``FSDPStrategy``, past its accelerator check (which looks for that exact type), saving full
    checkpoints without ``offload_to_cpu`` (see the module's docstring)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with _gathering_without_offload():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        with _gathering_without_offload():
            return super().optimizer_state(optimizer)


class ShardedByUser(ConformanceModel):
    """The conformance model as upstream's docs shard it in ``configure_model``: ``fully_shard`` per layer and on the
    root over the data-parallel mesh under ``ModelParallelStrategy``, FSDP1 per layer under ``FSDPStrategy`` (on the
    CPU device, see above). Our strategies shard it themselves."""

    def configure_model(self) -> None:
        if self._trainer is None:  # load_from_checkpoint builds a plain module
            return
        strategy = self._trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):
            mesh = strategy.device_mesh["data_parallel"]
            for layer in (self.encoder, self.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)
        elif isinstance(strategy, FSDPStrategy):
            cpu = torch.device("cpu")
            self.encoder = FullyShardedDataParallel(self.encoder, device_id=cpu, use_orig_params=True)
            self.head = FullyShardedDataParallel(self.head, device_id=cpu, use_orig_params=True)


class NoDecayGroups(ShardedByUser):
    """The usual no-weight-decay recipe: matrices in one group, biases in another, so the groups list parameters in
    another order than the module holds them (encoder.weight, head.weight | encoder.bias, head.bias)."""

    def configure_optimizers(self) -> Any:
        weights = [param for name, param in self.named_parameters() if name.endswith("weight")]
        biases = [param for name, param in self.named_parameters() if name.endswith("bias")]
        groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.02)


#: Builds the LightningModule of a run (on every rank, after seeding).
ModelClass = Callable[[], pl.LightningModule]


class _Losses(pl.Callback):
    """Every training step's loss on this rank."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.values.append(float(outputs["loss"]))


class GPT2ShardedByUser(GPT2Module):
    """The zoo's GPT-2 recipe (tied ``wte``/``lm_head``, AdamW with no-decay groups, linear warmup), sharded as
    upstream's users shard it under ``ModelParallelStrategy``: ``fully_shard`` per ``GPT2Block``, then the Hugging Face
    model."""

    def configure_model(self) -> None:
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ModelParallelStrategy):
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            mesh = strategy.device_mesh["data_parallel"]
            for block in [module for module in self.model.modules() if isinstance(module, GPT2Block)]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)  # the module the steps call (`self.model(**batch)`)


def upstream(distributed: bool) -> Callable[[], Any]:
    return lambda: ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )


OURS: dict[str, Callable[[], Any]] = {
    "ddp_sharded": lambda: "ddp_sharded",
    "fsdp_fairscale": lambda: "fsdp_fairscale",
    "fsdp2": lambda: "fsdp2",
}


OURS_SHARDED: dict[str, Callable[[], Any]] = {
    "fsdp2-sharded": lambda: FSDP2Strategy(state_dict_type="sharded"),
    "fsdp_fairscale-sharded": lambda: FairScaleFSDPStrategy(state_dict_type="sharded"),
}


def _fit(
    strategy: Callable[[], Any], root: Path, epochs: int, ckpt_path: Path | None, model_class: ModelClass
) -> list[float]:
    """Runs on every rank: trains, saving at each epoch's end (and right after a resume's restore)."""
    pl.seed_everything(7, verbose=False)
    model = model_class()
    losses = _Losses()
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1), losses]
    if ckpt_path is not None:
        callbacks.append(SaveAfterRestore(root / "restored.ckpt"))
    trainer = pl.Trainer(
        strategy=strategy(),
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return losses.values


def fit(
    strategy: Callable[[], Any],
    root: Path,
    epochs: int = EPOCHS,
    ckpt_path: Path | None = None,
    model_class: ModelClass = ShardedByUser,
) -> list[float]:
    """Rank 0's losses of a fit on two forked ranks."""
    return run_as_ranks(lambda: _fit(strategy, root, epochs, ckpt_path, model_class))[0]


def assert_continues(uninterrupted: list[float], resumed: list[float]) -> None:
    assert resumed, "the resumed run trained no step"
    tail = uninterrupted[len(uninterrupted) - len(resumed) :]
    assert torch.allclose(torch.tensor(resumed), torch.tensor(tail), rtol=LOSS_RTOL, atol=0), (resumed, tail)
