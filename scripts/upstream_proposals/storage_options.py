"""ModelParallelStrategy refuses ``storage_options`` for its distributed checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning_fabric.strategies.model_parallel as fabric_model_parallel
import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning_fabric.utilities.load import _METADATA_FILENAME
from lightning_fabric.wrappers import _unwrap_objects
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.fsdp import fully_shard

from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import ShardedByUser

#: What the reproduction asks for: one file per tensor instead of one per rank (DCP's ``FileSystemWriter`` option).
OPTIONS = {"single_file_per_rank": False}


class StorageOptionsForDCP(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy``; a distributed save passes ``storage_options`` to DCP's
    ``FileSystemWriter`` (``single_file_per_rank``, ``thread_count``, ``sync_files``, ...)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is None or not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # refuses options for full files
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp_save(state, storage_writer=FileSystemWriter(path, **storage_options))
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)
        return None


class FabricStorageOptionsForDCP(FabricModelParallelStrategy):
    """The same on Fabric's ``ModelParallelStrategy``: its DCP save (``_distributed_checkpoint_save``, patched for
    one call) gets the writer with the options."""

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        if storage_options is None or not self._save_distributed_checkpoint:
            return super().save_checkpoint(path, state, storage_options, filter)  # refuses options for full files

        def save(converted_state: dict[str, Any], directory: Path) -> None:
            dcp_save(converted_state, storage_writer=FileSystemWriter(directory, **storage_options))

        with mock.patch.object(fabric_model_parallel, "_distributed_checkpoint_save", save):
            return super().save_checkpoint(path, state, None, filter)


def _fit_and_save(root: Path, strategy: ModelParallelStrategy, model: Any) -> None:
    fitted = trainer(strategy, root)
    fitted.fit(model)
    fitted.save_checkpoint(root / "options.ckpt", storage_options=OPTIONS)


def _resume(root: Path, strategy: ModelParallelStrategy, model: Any) -> int:
    fitted = trainer(strategy, root / "resumed", max_epochs=2)
    fitted.fit(model, ckpt_path=root / "options.ckpt")
    return fitted.global_step


def reproduce(root: Path, cls: type) -> Outcome:
    """``trainer.save_checkpoint(path, storage_options={'single_file_per_rank': False})`` under ``cls``, then a
    resume from that directory."""
    on_two_ranks(lambda: _fit_and_save(root, cls(data_parallel_size=2, tensor_parallel_size=1), ShardedByUser()))
    files = sorted(path.name for path in (root / "options.ckpt").glob("*.distcp"))
    steps = on_two_ranks(lambda: _resume(root, cls(data_parallel_size=2, tensor_parallel_size=1), ShardedByUser()))
    return Outcome(len(files) > 2, f"saved {len(files)} `.distcp` files (2 ranks); the resume ran to step {steps[0]}")


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])


def test_save_distributed_checkpoint_passes_storage_options(tmp_path: Path, cls: type = StorageOptionsForDCP) -> None:
    on_two_ranks(
        lambda: _fit_and_save(tmp_path, cls(data_parallel_size=2, tensor_parallel_size=1), _ShardedBoringModel())
    )
    assert len(list((tmp_path / "options.ckpt").glob("*.distcp"))) > 2  # one file per tensor, not one per rank
    steps = on_two_ranks(
        lambda: _resume(tmp_path, cls(data_parallel_size=2, tensor_parallel_size=1), _ShardedBoringModel())
    )
    assert steps == [4, 4]


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_save_and_load(root: Path, cls: type) -> bool:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(_shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    saved, loaded = fabric.setup_module(nn.Linear(32, 4)), fabric.setup_module(nn.Linear(32, 4))
    # `Fabric.save` has no `storage_options`: the strategy's `save_checkpoint` is where they are passed
    fabric.strategy.save_checkpoint(root / "options", _unwrap_objects({"model": saved}), storage_options=OPTIONS)
    fabric.barrier()
    fabric.load(root / "options", {"model": loaded})
    pairs = zip(saved.parameters(), loaded.parameters(), strict=True)
    return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)


def test_fabric_save_distributed_checkpoint_passes_storage_options(
    tmp_path: Path, cls: type = FabricStorageOptionsForDCP
) -> None:
    assert on_two_ranks(lambda: _fabric_save_and_load(tmp_path, cls)) == [True, True]
    assert len(list((tmp_path / "options").glob("*.distcp"))) > 2  # one file per tensor, not one per rank


PROPOSAL = Proposal(
    slug="dcp-storage-options",
    title="Pass `storage_options` to the distributed checkpoint writer",
    kind="feature",
    issues=(21905,),
    severity="missing feature",
    status=f"open: `ModelParallelStrategy.save_checkpoint` raises `TypeError` for any `storage_options` on"
    f" {UPSTREAM_MAIN} (`FSDPStrategy` too)",
    template={
        "Description & Motivation": "DCP's writer has options that matter at scale: `thread_count` (write"
        " parallelism), `single_file_per_rank`, `sync_files`, `per_thread_copy_ahead`. `trainer.save_checkpoint("
        "..., storage_options=...)` exists for this, but `ModelParallelStrategy` and `FSDPStrategy` raise"
        " `TypeError` because they do not use a `CheckpointIO`.",
        "Pitch": "With a distributed save, `storage_options` are the `FileSystemWriter`'s keyword arguments;"
        " with a full save they stay refused (no writer to pass them to).",
        "Alternatives": "A custom `CheckpointIO` (the strategies bypass it); subclassing the strategy (what this"
        " page does, per user).",
    },
    change="`src/lightning/pytorch/strategies/model_parallel.py` `save_checkpoint` (and `fsdp.py`'s, and"
    " Fabric's `_distributed_checkpoint_save`): build `FileSystemWriter(path, **storage_options)` and pass it as"
    " `storage_writer` instead of `checkpoint_id=path`; keep the `TypeError` for full files. Here:"
    " `StorageOptionsForDCP`, which repeats upstream's DCP branch with the writer (upstream's change is two lines"
    " in that branch plus the condition of the `TypeError`), and `FabricStorageOptionsForDCP`, which passes the"
    " writer to Fabric's `_distributed_checkpoint_save` for one call.",
    cost="Behaviour: calls without options unchanged; calls with options that raised now save. An option DCP does"
    " not know raises DCP's `TypeError` at the save.",
    fix=(StorageOptionsForDCP,),
    released=ModelParallelStrategy,
    changed=StorageOptionsForDCP,
    reproduce=reproduce,
    tests=(
        test_save_distributed_checkpoint_passes_storage_options,
        test_fabric_save_distributed_checkpoint_passes_storage_options,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        f"Issue: {ISSUES}21905. The Fabric test goes into upstream's"
        " `tests_fabric/strategies/test_model_parallel_integration.py`: Fabric's"
        " `ModelParallelStrategy.save_checkpoint` raises the same `TypeError`.",
    ),
)
