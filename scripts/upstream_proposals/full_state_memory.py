"""A full save under ModelParallelStrategy holds the whole gathered state in rank 0's memory at once."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import ShardedByUser, fit

_SHARDED = StateDictOptions(full_state_dict=False)


class Spill:
    """Gathers a sharded state one tensor at a time; rank 0 moves each into a file-backed storage at once
    (``torch.save`` then reads them from the page cache, which the kernel can evict), so rank 0's heap holds one
    gathered tensor at most, not the whole state. :meth:`close` removes the files (after the write)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.directory: Path | None = None
        self.files = 0

    def gathered(self, value: Any) -> Any:
        """``value`` with every tensor gathered (on ranks other than 0: ``None`` in place of each tensor)."""
        if isinstance(value, dict):
            return {key: self.gathered(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.gathered(item) for item in value)
        if not isinstance(value, Tensor):
            return value
        full = value.full_tensor() if isinstance(value, DTensor) else value  # a collective: every rank calls it
        if self.rank != 0 or full.numel() == 0:
            return full if self.rank == 0 else None
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="full-save-"))
        self.files += 1
        file = self.directory / str(self.files)
        backed = torch.from_file(str(file), shared=True, size=full.numel(), dtype=full.dtype).view(full.shape)
        backed.copy_(full.detach().cpu())
        return backed

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory)
            self.directory = None


class GatheredOneAtATime(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy``; a full save gathers its state through a :class:`Spill`."""

    _spill: Spill | None = None

    def _gathered(self, value: Any) -> Any:
        if self._spill is None:
            self._spill = Spill(self.global_rank)
        return self._spill.gathered(value)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        state = self._gathered(get_model_state_dict(self.model, options=_SHARDED))
        return state if self.global_rank == 0 else {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer holds the torch optimizer
        state = self._gathered(get_optimizer_state_dict(self.model, optimizer, options=_SHARDED))
        if self.global_rank != 0:
            return {}
        return FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            if self._spill is not None:
                self._spill.close()
                self._spill = None


class FabricGatheredOneAtATime(FabricModelParallelStrategy):
    """The same on Fabric's ``ModelParallelStrategy``: ``_save_checkpoint``'s full state dicts (torch's
    ``get_model_state_dict`` and ``get_optimizer_state_dict``, patched for one call) come through a :class:`Spill`."""

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        if self._save_distributed_checkpoint:
            return super().save_checkpoint(path, state, storage_options, filter)
        spill = Spill(self.global_rank)

        def model_state(module: nn.Module, options: Any = None) -> Any:
            return spill.gathered(get_model_state_dict(module, options=_SHARDED))

        def optimizer_state(module: nn.Module, optimizer: Optimizer, options: Any = None) -> Any:
            return spill.gathered(get_optimizer_state_dict(module, optimizer, options=_SHARDED))

        patched = {"get_model_state_dict": model_state, "get_optimizer_state_dict": optimizer_state}
        try:
            with mock.patch.multiple(torch_state_dict, **patched):
                return super().save_checkpoint(path, state, storage_options, filter)
        finally:
            spill.close()


class _Measured(ShardedByUser):
    """Records, at the save, how many bytes of the checkpoint's tensors live in rank 0's heap (not file-backed)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == 0:
            tensors = _tensors([checkpoint["state_dict"], checkpoint["optimizer_states"]])
            heap = sum(t.untyped_storage().nbytes() for t in tensors if not t.untyped_storage().filename)
            largest = max(t.untyped_storage().nbytes() for t in tensors)
            total = sum(t.untyped_storage().nbytes() for t in tensors)
            directory = Path(self.trainer.checkpoint_callback.dirpath)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "measured.txt").write_text(f"{heap} {largest} {total}")


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return [value] if isinstance(value, Tensor) else []


def reproduce(root: Path, cls: type) -> Outcome:
    """A full save (``save_distributed_checkpoint=False``, Adam) measured on rank 0 when the checkpoint is built;
    the file is then resumed from."""
    full = lambda: cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)  # noqa: E731
    fit(full, root / "saved", epochs=1, model_class=_Measured)
    heap, largest, total = (int(word) for word in (root / "saved" / "measured.txt").read_text().split())
    fit(full, root / "resumed", ckpt_path=root / "saved" / "epoch=0.ckpt")
    return Outcome(
        heap <= largest,
        f"when the checkpoint was built, {heap} of its {total} tensor bytes were in rank 0's heap (largest tensor"
        f" {largest} bytes, the most a one-at-a-time gather holds); the file resumes",
    )


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters())


class _MeasuredBoringModel(_ShardedBoringModel):
    heap_and_largest = (0, 0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        tensors = _tensors([checkpoint["state_dict"], checkpoint["optimizer_states"]])
        heap = sum(t.untyped_storage().nbytes() for t in tensors if not t.untyped_storage().filename)
        self.heap_and_largest = (heap, max((t.untyped_storage().nbytes() for t in tensors), default=0))


def _save_measured(root: Path, cls: type) -> tuple[int, int]:
    model = _MeasuredBoringModel()
    fitted = trainer(cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False), root)
    fitted.fit(model)
    fitted.save_checkpoint(root / "full.ckpt")
    return model.heap_and_largest


def test_full_checkpoint_holds_at_most_one_gathered_tensor_in_memory(
    tmp_path: Path, cls: type = GatheredOneAtATime
) -> None:
    heap, largest = on_two_ranks(lambda: _save_measured(tmp_path, cls))[0]
    assert heap <= largest


def _save(root: Path, cls: type) -> None:
    fitted = trainer(cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False), root)
    fitted.fit(_ShardedBoringModel())
    fitted.save_checkpoint(root / "full.ckpt")


def test_full_checkpoint_gathered_one_tensor_at_a_time_is_complete(
    tmp_path: Path, cls: type = GatheredOneAtATime
) -> None:
    on_two_ranks(lambda: _save(tmp_path, cls))
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert checkpoint["state_dict"]["layer.weight"].shape == (2, 32)
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].shape == (2, 32)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["params"] == [0, 1]


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_save_measured(root: Path, cls: type) -> tuple[int, int]:
    """A full ``fabric.save`` after an Adam step; of what rank 0's ``torch.save`` got: heap bytes, largest tensor."""
    strategy = cls(_shard, data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(nn.Linear(32, 4))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(2, 32)).sum())
    optimizer.step()
    measured = [(0, 0)]
    save = torch.save

    def measuring_save(obj: Any, *args: Any, **kwargs: Any) -> None:
        storages = [tensor.untyped_storage() for tensor in _tensors(obj)]
        heap = sum(storage.nbytes() for storage in storages if not storage.filename)
        measured[0] = (heap, max((storage.nbytes() for storage in storages), default=0))
        save(obj, *args, **kwargs)

    with mock.patch.object(torch, "save", measuring_save):
        fabric.save(root / "full.ckpt", {"model": model, "optimizer": optimizer})
    return measured[0]


def test_fabric_full_checkpoint_holds_at_most_one_gathered_tensor_in_memory(
    tmp_path: Path, cls: type = FabricGatheredOneAtATime
) -> None:
    heap, largest = on_two_ranks(lambda: _fabric_save_measured(tmp_path, cls))[0]
    assert largest > 0 and heap <= largest
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert checkpoint["model"]["weight"].shape == (4, 32)
    assert checkpoint["optimizer"]["state"]["weight"]["exp_avg"].shape == (4, 32)


PROPOSAL = Proposal(
    slug="full-save-memory",
    title="Full-state saves hold the whole gathered model and optimizer state in rank 0's memory",
    kind="bug",
    issues=(20312, 11207),
    severity="crash (out of memory on rank 0)",
    status=f"open: `lightning_module_state_dict` and `optimizer_state` gather with `full_state_dict=True` into one"
    f" dict on {UPSTREAM_MAIN} (`FSDPStrategy`'s full context likewise)",
    template={
        "Bug description": "A full save (`ModelParallelStrategy(save_distributed_checkpoint=False)`,"
        " `FSDPStrategy(state_dict_type='full')`) gathers the whole model, then the whole optimizer state, into"
        " rank 0's host memory before `torch.save` writes a byte: model + 2x model for Adam. A model that trains"
        " sharded on N hosts cannot be saved as one file unless one host holds all of it: the save is killed for"
        " memory, after hours of training.",
        "Reproduction": "Full save of a sharded model with Adam; count, when the checkpoint is built, the bytes of"
        " its tensors that sit in rank 0's heap.",
        "Expected": "At most one gathered tensor in memory at a time (the rest streamed to disk or file-backed).",
        "Actual": "All of the checkpoint's bytes at once.",
        "Environment": "pytorch-lightning 2.6.6, torch 2.13, 2 CPU processes (gloo); measured structurally"
        " (where each tensor's storage lives), not by RSS, so the tiny model shows it.",
    },
    change="`src/lightning/pytorch/strategies/model_parallel.py`, `lightning_module_state_dict` and"
    " `optimizer_state` (full case): take the sharded state dict, gather one tensor at a time (`full_tensor()`),"
    " and on rank 0 copy each into a file-backed storage (`torch.from_file(..., shared=True)`) before the next is"
    " gathered; `save_checkpoint` removes the files after the write (and the same in Fabric's `_save_checkpoint`)."
    " Here: `Spill`, used by `GatheredOneAtATime` (and by `FabricGatheredOneAtATime`, which patches torch's two"
    " state-dict functions for one `save_checkpoint` call). This is the minimal version: the complete fix writes"
    " each gathered tensor straight into the checkpoint file (the zip format allows appending records one at a"
    " time) instead of through temporary files, which is what this package's full saves do; that is a larger change"
    " (a writer beside `torch.save`).",
    cost="Behaviour: the file is the same (keys, layout, param-id re-keying as upstream). Cost: one collective per"
    " tensor instead of one per state dict (slower for many small tensors), and temporary disk space equal to the"
    " checkpoint in the temp directory during the save. Risk: a temp directory on a small or RAM-backed (tmpfs)"
    " filesystem moves the problem there; the complete version has no temporary files.",
    fix=(Spill, GatheredOneAtATime),  # Fabric's: the same calls
    released=ModelParallelStrategy,
    changed=GatheredOneAtATime,
    reproduce=reproduce,
    tests=(
        test_full_checkpoint_holds_at_most_one_gathered_tensor_in_memory,
        test_full_checkpoint_gathered_one_tensor_at_a_time_is_complete,
        test_fabric_full_checkpoint_holds_at_most_one_gathered_tensor_in_memory,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        f"Issues: {ISSUES}20312, {ISSUES}11207. The Fabric test goes into upstream's"
        " `tests_fabric/strategies/test_model_parallel_integration.py`: Fabric's full save"
        " (`save_distributed_checkpoint=False`) gathers the whole state into rank 0's memory the same way.",
    ),
)
