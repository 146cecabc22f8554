"""ModelParallelStrategy offers no asynchronous distributed save: training waits for every byte to be written."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from unittest import mock

import lightning_fabric.strategies.model_parallel as fabric_model_parallel
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter, async_save
from torch.distributed.fsdp import fully_shard

from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import ShardedByUser


class AsyncDCPSaves(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy`` with ``async_save=True``: a distributed save copies the state to host
    memory and returns; DCP writes it in a background thread over a gloo group of its own. The next save, a load
    and the teardown wait for the write."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self._write: Future[Any] | None = None
        self._write_group: Any = None

    def wait_for_checkpoint(self) -> None:
        """Returns when the last asynchronous save is on disk (raising its error, if it failed)."""
        if self._write is not None:
            write, self._write = self._write, None
            write.result()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.wait_for_checkpoint()
        if not (self.async_save and self._save_distributed_checkpoint):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self._write_group is None:  # the background thread's collectives must not meet the training's
            self._write_group = dist.new_group(backend="gloo")
        self._write = async_save(state, checkpoint_id=path, process_group=self._write_group)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        return super().load_checkpoint(checkpoint_path, weights_only)

    def teardown(self) -> None:
        self.wait_for_checkpoint()
        super().teardown()


class FabricAsyncDCPSaves(FabricModelParallelStrategy):
    """The same option on Fabric's ``ModelParallelStrategy``: its DCP save (``_distributed_checkpoint_save``, patched
    for one call) starts ``async_save`` and keeps the future; the next save, a load and the teardown wait for it."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self._write: Future[Any] | None = None
        self._write_group: Any = None

    def wait_for_checkpoint(self) -> None:
        """Returns when the last asynchronous save is on disk (raising its error, if it failed)."""
        if self._write is not None:
            write, self._write = self._write, None
            write.result()

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        self.wait_for_checkpoint()
        if not (self.async_save and self._save_distributed_checkpoint):
            return super().save_checkpoint(path, state, storage_options, filter)
        if self._write_group is None:  # the background thread's collectives must not meet the training's
            self._write_group = dist.new_group(backend="gloo")

        def save(converted_state: dict[str, Any], directory: Path) -> None:
            self._write = async_save(converted_state, checkpoint_id=directory, process_group=self._write_group)

        with mock.patch.object(fabric_model_parallel, "_distributed_checkpoint_save", save):
            return super().save_checkpoint(path, state, storage_options, filter)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait_for_checkpoint()
        return super().load_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        self.wait_for_checkpoint()
        super().teardown()


@contextlib.contextmanager
def _writes_held(events: list[str]) -> Iterator[threading.Event]:
    """DCP's file writes wait (up to 1 s) for the event and then record ``"written"`` in ``events``."""
    returned = threading.Event()
    write = FileSystemWriter.write_data

    def slow_write(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        returned.wait(timeout=1.0)
        events.append("written")
        return write(self, *args, **kwargs)

    with mock.patch.object(FileSystemWriter, "write_data", slow_write):
        yield returned


def _save_and_order(root: Path, strategy: ModelParallelStrategy, model: Any) -> list[str]:
    """Fit, then save while DCP's writes wait (up to 1 s) for the save call to return: the order the two happened."""
    fitted = trainer(strategy, root)
    fitted.fit(model)
    events: list[str] = []
    with _writes_held(events) as returned:
        fitted.save_checkpoint(root / "async.ckpt")
        events.append("returned")
        returned.set()
        fitted.strategy.teardown()  # waits for the write (as the end of fit does)
    return events


def _resume(root: Path, strategy: ModelParallelStrategy, model: Any) -> int:
    fitted = trainer(strategy, root / "resumed", max_epochs=2)
    fitted.fit(model, ckpt_path=root / "async.ckpt")
    return fitted.global_step


def _strategy(cls: type) -> ModelParallelStrategy:
    options: dict[str, Any] = {"async_save": True} if cls is AsyncDCPSaves else {}
    strategy: ModelParallelStrategy = cls(data_parallel_size=2, tensor_parallel_size=1, **options)
    return strategy


def reproduce(root: Path, cls: type) -> Outcome:
    """A distributed save whose file writes are held back until the save call returns; then a resume from it."""
    orders = on_two_ranks(lambda: _save_and_order(root, _strategy(cls), ShardedByUser()))
    steps = on_two_ranks(lambda: _resume(root, _strategy(cls), ShardedByUser()))
    background = all(order == ["returned", "written"] for order in orders)
    when = "before" if background else "only after"
    return Outcome(
        background,
        f"the save returned {when} its files were written (rank 0: {' then '.join(orders[0])}); the resume ran to"
        f" step {steps[0]}",
    )


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])


def _weights_after_fit(root: Path, strategy: ModelParallelStrategy) -> dict[str, list[Any]]:
    fitted = trainer(strategy, root)
    fitted.fit(_ShardedBoringModel())
    fitted.save_checkpoint(root / "async.ckpt")
    weights = {key: value.full_tensor().tolist() for key, value in fitted.lightning_module.state_dict().items()}
    with torch.no_grad():  # training goes on while the write is pending: the checkpoint must not see it
        for param in fitted.lightning_module.parameters():
            param.add_(1.0)
    fitted.strategy.teardown()
    return weights


def _restored_weights(root: Path, strategy: ModelParallelStrategy) -> dict[str, list[Any]]:
    model = _ShardedBoringModel()
    model.on_train_start = _stop  # type: ignore[method-assign]
    with contextlib.suppress(StopIteration):  # what the test reads is the state right after the restore
        trainer(strategy, root / "resumed", max_epochs=2).fit(model, ckpt_path=root / "async.ckpt")
    return {key: value.full_tensor().tolist() for key, value in model.state_dict().items()}


def _stop() -> None:
    raise StopIteration


def test_async_distributed_checkpoint_holds_the_state_at_the_save(tmp_path: Path, cls: type = AsyncDCPSaves) -> None:
    saved = on_two_ranks(lambda: _weights_after_fit(tmp_path, _strategy(cls)))
    restored = on_two_ranks(lambda: _restored_weights(tmp_path, _strategy(cls)))
    assert restored[0] == saved[0]  # exactly: the weights at the save, not the ones changed while it was written


def test_async_distributed_checkpoint_returns_before_the_write(tmp_path: Path, cls: type = AsyncDCPSaves) -> None:
    orders = on_two_ranks(lambda: _save_and_order(tmp_path, _strategy(cls), _ShardedBoringModel()))
    assert orders == [["returned", "written"]] * 2


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_save_and_order(root: Path, cls: type) -> list[str]:
    strategy = cls(_shard, data_parallel_size=2, tensor_parallel_size=1, async_save=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(nn.Linear(32, 4))
    events: list[str] = []
    with _writes_held(events) as returned:
        fabric.save(root / "async.ckpt", {"model": model})
        events.append("returned")
        returned.set()
        strategy.wait_for_checkpoint()  # what the next save, a load and the teardown call
    return events


def test_fabric_async_distributed_checkpoint_returns_before_the_write(
    tmp_path: Path, cls: type = FabricAsyncDCPSaves
) -> None:
    assert on_two_ranks(lambda: _fabric_save_and_order(tmp_path, cls)) == [["returned", "written"]] * 2
    assert (tmp_path / "async.ckpt" / ".metadata").is_file()


PROPOSAL = Proposal(
    slug="async-dcp-save",
    title="Asynchronous distributed checkpoint saves for ModelParallelStrategy",
    kind="feature",
    issues=(21557,),
    severity="missing feature",
    status=f"open: no asynchronous save in `ModelParallelStrategy` or Fabric's `_save_checkpoint` on"
    f" {UPSTREAM_MAIN}; PR 21515 (unmerged) proposes one",
    template={
        "Description & Motivation": "torch's `torch.distributed.checkpoint.async_save` copies the state to host"
        " memory and writes it in the background; for large models the write is minutes of idle accelerators per"
        " save. `AsyncCheckpointIO` does not help: `ModelParallelStrategy` bypasses the `CheckpointIO`.",
        "Pitch": "`ModelParallelStrategy(async_save=True)`: a distributed save returns once the state is staged;"
        " the next save, a load and the end of training wait for the write.",
        "Alternatives": "`AsyncCheckpointIO` (bypassed, and it would pickle a full state anyway); saving less often.",
    },
    change="`src/lightning/pytorch/strategies/model_parallel.py`: an `async_save` flag; `save_checkpoint` calls"
    " `torch.distributed.checkpoint.async_save` over a gloo group made once (the background thread's collectives"
    " must not interleave with the training's on the default group) and keeps the future; `save_checkpoint`,"
    " `load_checkpoint` and `teardown` wait for it. Here: `AsyncDCPSaves`, a subclass. The complete version also"
    " writes `meta.pt` only after the write finished (here it is written at once, so a crash mid-write leaves a"
    " directory that looks complete until `.metadata` is missing). Fabric's `ModelParallelStrategy` gets the same"
    " option (`_save_checkpoint` starts the write, `load_checkpoint` and `teardown` wait): `FabricAsyncDCPSaves`.",
    cost="Behaviour: unchanged unless `async_save=True`. Memory: one host copy of this rank's shard while a write is"
    " pending. Risk: a crash during the background write loses that checkpoint (the previous one is intact as"
    " long as `ModelCheckpoint` removes it only after the next save, which it does).",
    fix=(AsyncDCPSaves,),
    released=ModelParallelStrategy,
    changed=AsyncDCPSaves,
    reproduce=reproduce,
    tests=(
        test_async_distributed_checkpoint_returns_before_the_write,
        test_async_distributed_checkpoint_holds_the_state_at_the_save,
        test_fabric_async_distributed_checkpoint_returns_before_the_write,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        f"Issue: {ISSUES}21557; PR 21515. The Fabric test goes into upstream's"
        " `tests_fabric/strategies/test_model_parallel_integration.py`: `fabric.save` of a distributed checkpoint"
        " waits for every byte the same way.",
    ),
)
